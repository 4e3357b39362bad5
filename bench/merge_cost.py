#!/usr/bin/env python3
"""The cost of one Chelsea merge step next to one compaction, and the error re-quantising merged rows adds.

Cost: for each engine (native: the device merge with the log-count bias;
state: the host merge through llama.cpp's state API), cache type and size n,
the default model holds n cells of Jane Austen's prose; one step of Chelsea's first rate merges
``r_init`` of the cells between sinks and window. It is timed as its two
halves, the matching on the host (snapshot keys, chunked soft matching) and
the engine's merge (averages, re-quantisation, the compaction of the
sources), interleaved with one compaction that removes the same number of
cells (knorm selection, not timed), from the same saved prefill.

Error: after that merge step, each merged row is compared with the exact
count-weighted mean of the rows it absorbed (as the cache held them before),
as a relative RMS error per cache type, next to the error the cache type
makes on the model's own rows (the f16 cache's rows, quantised by the numpy
codecs, in llama.cpp's Hadamard-rotated space).

    .venv/bin/edgekv bench run merge_cost --sizes 1024,4096
writes bench/results/merge_cost.json.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from edgekv.bench.results import machine, write_json


def rel_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want ** 2)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--sizes", default="1024,4096")
    ap.add_argument("--configs", default="native:f16:off,native:f16:on,native:q8_0:on,state:f16:off,state:q8_0:on,"
                                         "state:q4_0:on", help="engine:cache type:flash attention, comma-separated")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="merge_cost")
    a = ap.parse_args()

    from rich.progress import Progress

    from edgekv.bench.speed import long_text_tokens
    from edgekv.ggml_types import type_by_name
    from edgekv.kvcache.quant import dequantize, quantize
    from edgekv.kvcache.snapshot import unrotate
    from edgekv.methods import get_method
    from edgekv.methods.chelsea import match
    from edgekv.models import resolve_model
    from edgekv.session import Session

    path = resolve_model(a.model)
    sizes = [int(s) for s in a.sizes.split(",")]
    configs = [c.split(":") for c in a.configs.split(",")]
    rows = []
    chelsea = get_method("chelsea")
    knorm = get_method("knorm")
    with Progress(transient=True) as prog:
        task = prog.add_task("merge cost", total=len(sizes) * len(configs))
        for engine, ct, fa in configs:
            sess = Session(path, method="full", n_ctx=max(sizes) + 64, chunk=512, engine=engine,
                           cache_type_k=ct, cache_type_v=ct, flash_attn=fa, n_threads=a.threads)
            toks = long_text_tokens(sess.model, max(sizes))  # real prose: neighbours differ as in use
            for n in sizes:
                sess.reset()
                sess.feed(toks[:n])
                saved = sess.save()
                snap = sess.engine.snapshot()
                middle = chelsea.middle(snap)
                m = math.floor(chelsea.rate(0) * middle.shape[2])
                src, dst = match(snap, middle, chelsea.chunk, m)
                keep = knorm.select(snap, n - m)
                before = {il: (snap.keys(il).copy(), snap.values(il).copy()) for il in range(snap.n_layer)}
                t_match, t_merge, t_compact = [], [], []
                for _ in range(a.repeat):  # interleaved: merge step, then compaction, from one prefill
                    sess.restore(saved)
                    t0 = time.perf_counter()
                    s = sess.engine.snapshot()
                    match(s, chelsea.middle(s), chelsea.chunk, m)
                    t1 = time.perf_counter()
                    sess.engine.merge(src, dst, bias=engine == "native")
                    t2 = time.perf_counter()
                    t_match.append(t1 - t0)
                    t_merge.append(t2 - t1)
                    ms = sess.engine.snapshot()  # read now: a native snapshot is lazy
                    merged = (ms.token_pos, [(ms.keys(il).copy(), ms.values(il).copy()) for il in range(ms.n_layer)])
                    sess.restore(saved)
                    t0 = time.perf_counter()
                    sess.engine.compact(keep)
                    t_compact.append(time.perf_counter() - t0)
                err_k, err_v, ref_k, ref_v = [], [], [], []
                counts = np.ones((snap.n_layer, snap.n_kv_head, n))
                for il in range(snap.n_layer):
                    k0, v0 = before[il]
                    for h in range(snap.n_kv_head):
                        dsts = np.unique(dst[il, h])
                        want_k, want_v = k0[dsts, h].copy(), v0[dsts, h].copy()
                        cnt = counts[il, h, dsts].copy()
                        for s_, d_ in zip(src[il, h], dst[il, h], strict=True):
                            j = np.searchsorted(dsts, d_)
                            want_k[j] += k0[s_, h]
                            want_v[j] += v0[s_, h]
                            cnt[j] += 1
                        want_k /= cnt[:, None]
                        want_v /= cnt[:, None]
                        cells = np.searchsorted(merged[0][il, h], snap.token_pos[il, h, dsts])
                        err_k.append((merged[1][il][0][cells, h], want_k))
                        err_v.append((merged[1][il][1][cells, h], want_v))
                        ref_k.append(k0[:, h])
                        ref_v.append(v0[:, h])
                gk, wk = (np.concatenate(x) for x in zip(*err_k, strict=True))
                gv, wv = (np.concatenate(x) for x in zip(*err_v, strict=True))
                row = {"engine": engine, "cache_type": ct, "flash_attn": fa, "cells": n, "merged_away": m,
                       "match_s": statistics.median(t_match), "merge_s": statistics.median(t_merge),
                       "compact_s": statistics.median(t_compact),
                       "merge_step_over_compact": (statistics.median(t_match) + statistics.median(t_merge))
                       / statistics.median(t_compact),
                       "merged_rows": int(gk.shape[0]), "requant_rel_rms_k": rel_rms(gk, wk),
                       "requant_rel_rms_v": rel_rms(gv, wv)}
                if ct == "f16":
                    # what each quantised type does to the model's own rows, in llama.cpp's rotated space
                    x = np.concatenate(ref_k)
                    block = 64
                    while x.shape[1] % (2 * block) == 0:
                        block *= 2
                    xr = unrotate(x, min(block, x.shape[1]))
                    for qt in ("q8_0", "q4_0"):
                        tid = type_by_name(qt).id
                        row[f"own_rel_rms_k_{qt}"] = rel_rms(dequantize(quantize(xr, tid), tid, x.shape[1]), xr)
                rows.append(row)
                prog.advance(task)
            sess.close()
    payload = {"bench": "merge_cost", "machine": machine(), "model": path.name, "args": vars(a), "rows": rows}
    out = write_json(a.out, payload)
    print(f"wrote {out}")
    print(f"{'engine':7s} {'type':5s} {'fa':3s} {'cells':>6s} {'merged':>7s} {'match ms':>9s} {'merge ms':>9s} "
          f"{'compact ms':>11s} {'step/compact':>13s} {'err K':>8s} {'err V':>8s}")
    for r in rows:
        print(f"{r['engine']:7s} {r['cache_type']:5s} {r['flash_attn']:3s} {r['cells']:6d} {r['merged_away']:7d} "
              f"{1e3 * r['match_s']:9.1f} {1e3 * r['merge_s']:9.1f} {1e3 * r['compact_s']:11.1f} "
              f"{r['merge_step_over_compact']:13.2f} {r['requant_rel_rms_k']:8.5f} {r['requant_rel_rms_v']:8.5f}")


if __name__ == "__main__":
    main()
