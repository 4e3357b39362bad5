#!/usr/bin/env python3
"""Time per compaction against cache size, per engine, next to a plain copy of the same bytes.

For each engine (state: host round trip through llama.cpp's state API;
native: edgekv's ggml graph where the cache lives), cache size n and cache
type, the cache holds n cells of the default model; one compaction keeps half
the cells per (layer, KV head) (knorm selection, timed separately). The
reference is a memory copy of the sequence's state blob (the K/V bytes plus
a little metadata).

    .venv/bin/python bench/compaction.py --sizes 512,1024,2048,4096
writes bench/results/compaction.json and compaction.png.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from edgekv.bench.results import RESULTS, machine, write_json


def timeit(fn, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--sizes", default="512,1024,2048,4096")
    ap.add_argument("--cache-types", default="f16,q8_0")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--engines", default="state,native")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="compaction")
    a = ap.parse_args()

    from rich.progress import Progress

    from edgekv.methods import get_method
    from edgekv.models import resolve_model
    from edgekv.session import Session

    path = resolve_model(a.model)
    sizes = [int(s) for s in a.sizes.split(",")]
    rows = []
    text = ("The quick brown fox jumps over the lazy dog while the archive keeps every record "
            "of the harbour town in order. ") * 400
    with Progress(transient=True) as prog:
        combos = [(e, ct) for e in a.engines.split(",") for ct in a.cache_types.split(",")]
        task = prog.add_task("compaction", total=len(sizes) * len(combos))
        for engine, ct in combos:
            sess = Session(path, method="knorm", n_ctx=max(sizes) + 256, chunk=512, engine=engine,
                           cache_type_k=ct, cache_type_v=ct, flash_attn="on", n_threads=a.threads)
            toks = sess.model.tokenize(text)
            while len(toks) < max(sizes):
                toks = toks + toks
            for n in sizes:
                sess.reset()
                sess.feed(toks[:n])
                saved = sess.save()
                blob_bytes = len(saved[0].blob)
                method = get_method("knorm")
                snap = sess.engine.snapshot()
                keep = method.select(snap, n // 2)

                def snapshot_only(sess=sess):
                    sess.engine.snapshot()

                def select_only(snap=snap, method=method, n=n):
                    snap._k.clear()
                    method.select(snap, n // 2)

                def compact_only(sess=sess, saved=saved, keep=keep):
                    sess.restore(saved)
                    t0 = time.perf_counter()
                    sess.engine.compact(keep)
                    return time.perf_counter() - t0

                def restore_only(sess=sess, saved=saved):
                    sess.restore(saved)

                # snapshot and selection first: a native snapshot reads the live cache lazily
                t_snap = timeit(snapshot_only, a.repeat)
                t_select = timeit(select_only, a.repeat)
                t_restore = timeit(restore_only, a.repeat)
                compact_times = [compact_only() for _ in range(a.repeat)]
                t_compact = statistics.median(compact_times)
                src = np.frombuffer(saved[0].blob, np.uint8)
                dst = np.empty_like(src)
                t_copy = timeit(lambda src=src, dst=dst: np.copyto(dst, src), a.repeat * 4)
                rows.append({"engine": engine, "cache_type": ct, "cells": n, "blob_bytes": blob_bytes,
                             "compact_s": t_compact, "snapshot_dequant_s": t_snap,
                             "select_knorm_s": t_select, "restore_s": t_restore,
                             "memcpy_s": t_copy, "compact_over_memcpy": t_compact / t_copy})
                prog.advance(task)
            sess.close()
    payload = {"bench": "compaction", "machine": machine(), "model": path.name,
               "args": vars(a), "rows": rows}
    out = write_json(a.out, payload)
    plot(rows, RESULTS / f"{a.out}.png")
    print(f"wrote {out}")
    print(f"{'engine':7s} {'type':6s} {'cells':>6s} {'MB':>7s} {'compact ms':>11s} {'memcpy ms':>10s} {'snapshot ms':>12s} {'knorm ms':>9s}")
    for r in rows:
        print(f"{r['engine']:7s} {r['cache_type']:6s} {r['cells']:6d} {r['blob_bytes'] / 1e6:7.1f} {1e3 * r['compact_s']:11.2f} "
              f"{1e3 * r['memcpy_s']:10.3f} {1e3 * r['snapshot_dequant_s']:12.2f} {1e3 * r['select_knorm_s']:9.2f}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for eng, ct in sorted({(r["engine"], r["cache_type"]) for r in rows}):
        rs = [r for r in rows if r["cache_type"] == ct and r["engine"] == eng]
        x = [r["cells"] for r in rs]
        ax.plot(x, [1e3 * r["compact_s"] for r in rs], marker="o", label=f"{eng} engine compact ({ct})")
        if eng == "state":
            ax.plot(x, [1e3 * r["memcpy_s"] for r in rs], marker="x", ls=":", label=f"memcpy of blob ({ct})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cells in the cache before compaction")
    ax.set_ylabel("ms")
    ax.set_title("compaction to half the cells, SmolLM2-135M")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
