#!/usr/bin/env python3
"""Time per compaction against cache size, per engine and path, next to a plain copy of the same bytes.

For each engine (state: host round trip through llama.cpp's state API;
native: edgekv's op, by its host path, plain byte moves where the cache is in
host memory, and by its ggml graph, the path GPUs take, forced with
EDGEKV_GRAPH_OPS=1), V layout (flash attention on: V rows like K; off:
llama.cpp stores V transposed, one row per channel), cache size n and cache
type, the cache holds n cells of the default model; one compaction keeps half
the cells per (layer, KV head) (knorm selection, timed separately). The
references are memory copies: of the sequence's state blob (the K/V bytes plus a
little metadata), and of the bytes a compaction moves (the kept half), on one
thread and on the sessions' threads, which the host path shares its tensors out
over; the faster of the two is the bound. And the same gather outside llama.cpp (numpy
fancy indexing, one thread), what the access pattern itself costs. Engines and paths take
turns on every repeat.

    .venv/bin/edgekv bench run compaction --sizes 512,1024,2048,4096
writes bench/results/compaction.json and compaction.png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from edgekv.bench.results import RESULTS, machine, write_json

PATHS = {"state": ("state", None), "native-host": ("native", "0"), "native-graph": ("native", "1")}


def copy_threads(src: np.ndarray, dst: np.ndarray, pool: ThreadPoolExecutor, k: int) -> None:
    """Copy ``src`` into ``dst`` in k equal parts, part 0 on this thread and the others on
    the pool (numpy copies without the GIL), as the host compaction shares its tensors out."""
    cut = [src.size * i // k for i in range(k + 1)]
    rest = [pool.submit(np.copyto, dst[cut[i]:cut[i + 1]], src[cut[i]:cut[i + 1]]) for i in range(1, k)]
    np.copyto(dst[: cut[1]], src[: cut[1]])
    for f in rest:
        f.result()


def gather_reference(keep: np.ndarray, n: int, k_row: int, v_row: int, v_trans: bool, v_el: int):
    """The same gather outside llama.cpp: ``np.take`` (one thread) of each (layer, head)'s
    kept rows, K and V, from arrays of the cache's shape into preallocated ones; a
    transposed V gathers single elements of each channel row. What the access pattern
    alone costs."""
    L, H, _ = keep.shape
    li, hi = np.arange(L)[:, None, None], np.arange(H)[None, :, None]

    def taker(src: np.ndarray, idx: np.ndarray):
        out = np.empty(idx.size, src.dtype)
        return lambda: np.take(src, idx, out=out)

    rows = ((li * n + keep) * H + hi).ravel()  # row (layer, cell, head) of the flat tensors
    k = taker(np.zeros(L * n * H, np.dtype((np.void, k_row))), rows)  # one item per row: moved whole
    if not v_trans:
        v = taker(np.zeros(L * n * H, np.dtype((np.void, v_row))), rows)
    else:
        d = v_row // v_el  # channels per head; each channel row gathers its head's cells
        ci = np.arange(H * d)[None, :, None]
        v = taker(np.zeros(L * H * d * n, np.uint16 if v_el == 2 else np.uint32),
                  ((li * H * d + ci) * n + np.repeat(keep, d, axis=1)).ravel())
    return lambda: (k(), v())


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
    ap.add_argument("--flash-attn", default="on,off", help="on: V rows like K; off: transposed V (f16 only)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--engines", default=",".join(PATHS))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="compaction")
    a = ap.parse_args()

    from rich.progress import Progress

    from edgekv.ggml_types import row_size, type_by_name
    from edgekv.llama import UNQUANTISED_V
    from edgekv.methods import get_method
    from edgekv.models import resolve_model
    from edgekv.session import Session

    path = resolve_model(a.model)
    sizes = [int(s) for s in a.sizes.split(",")]
    engines = a.engines.split(",")
    rows = []
    text = ("The quick brown fox jumps over the lazy dog while the archive keeps every record "
            "of the harbour town in order. ") * 400
    combos = [(ct, fa) for fa in a.flash_attn.split(",") for ct in a.cache_types.split(",")
              if fa == "on" or ct in UNQUANTISED_V]
    with Progress(transient=True) as prog:
        task = prog.add_task("compaction", total=len(sizes) * len(combos))
        for ct, fa in combos:
            sessions = {e: Session(path, method="knorm", n_ctx=max(sizes) + 256, chunk=512,
                                   engine=PATHS[e][0], cache_type_k=ct, cache_type_v=ct, flash_attn=fa,
                                   n_threads=a.threads) for e in engines}
            toks = next(iter(sessions.values())).model.tokenize(text)
            threads = a.threads or max(1, os.cpu_count() or 1)  # the sessions' default
            while len(toks) < max(sizes):
                toks = toks + toks
            for n in sizes:
                saved, keep, times = {}, None, {e: [] for e in engines}
                for e, sess in sessions.items():
                    sess.reset()
                    sess.feed(toks[:n])
                    saved[e] = sess.save()
                    if keep is None:
                        keep = get_method("knorm").select(sess.engine.snapshot(), n // 2)
                for _ in range(a.repeat):  # the paths take turns
                    for e, sess in sessions.items():
                        sess.restore(saved[e])
                        flag = PATHS[e][1]
                        if flag is not None:
                            os.environ["EDGEKV_GRAPH_OPS"] = flag
                        t0 = time.perf_counter()
                        sess.engine.compact(keep)
                        times[e].append(time.perf_counter() - t0)
                os.environ.pop("EDGEKV_GRAPH_OPS", None)
                blob = np.frombuffer(saved[engines[0]][0].blob, np.uint8)
                moved = blob[: blob.size * (n // 2) // n]  # the kept cells' share of the K/V bytes
                whole = np.empty_like(blob)
                t_copy = timeit(lambda src=blob, dst=whole: np.copyto(dst, src), a.repeat * 4)
                out = np.empty_like(moved)
                with ThreadPoolExecutor(max(1, threads - 1)) as pool:
                    t_moved = {k: timeit(lambda k=k, src=moved, dst=out, pool=pool: copy_threads(src, dst, pool, k),
                                         a.repeat * 4) for k in (1, threads)}
                eng = next(iter(sessions.values())).engine
                k_row = row_size(type_by_name(ct).id, eng.head_dim_k)
                v_el = 2 if fa == "off" else 0  # a transposed V is f16 here (quantised V needs flash attention)
                v_row = row_size(type_by_name(ct).id, eng.head_dim_v) if fa == "on" else eng.head_dim_v * v_el
                t_gather = timeit(gather_reference(keep, n, k_row, v_row, fa == "off", v_el), a.repeat * 2)
                for e, sess in sessions.items():
                    snap = sess.engine.snapshot() if e != "native-graph" else None
                    row = {"engine": e, "cache_type": ct, "flash_attn": fa, "v_trans": fa == "off",
                           "cells": n, "blob_bytes": blob.size, "compact_s": statistics.median(times[e]),
                           "memcpy_s": t_copy, "moved_bytes": moved.size, "threads": threads,
                           "memcpy_moved_1t_s": t_moved[1], "memcpy_moved_nt_s": t_moved[threads],
                           "gather_numpy_1t_s": t_gather}
                    row["compact_over_memcpy"] = row["compact_s"] / t_copy
                    # the bound: the faster copy (on small sizes, the threads' start costs more)
                    row["compact_over_memcpy_moved"] = row["compact_s"] / min(t_moved.values())
                    row["compact_over_gather"] = row["compact_s"] / t_gather
                    if snap is not None:  # a host snapshot and knorm's scores (the native one reads lazily)
                        method = get_method("knorm")

                        def snap_select(sess=sess, method=method, n=n):
                            method.select(sess.engine.snapshot(), n // 2)
                        sess.restore(saved[e])
                        row["snapshot_select_knorm_s"] = timeit(snap_select, a.repeat)
                    rows.append(row)
                prog.advance(task)
            for sess in sessions.values():
                sess.close()
    payload = {"bench": "compaction", "machine": machine(), "model": path.name,
               "args": vars(a), "rows": rows}
    out = write_json(a.out, payload)
    plot(rows, RESULTS / f"{a.out}.png")
    print(f"wrote {out}")
    print(f"{'engine':13s} {'type':5s} {'V':6s} {'cells':>6s} {'MB':>6s} {'compact ms':>11s} {'memcpy ms':>10s} "
          f"{'moved MB':>9s} {'1t ms':>7s} {'Nt ms':>7s} {'ratio':>6s} {'gather ms':>10s} {'ratio':>6s} "
          f"{'snap+knorm ms':>14s}")
    for r in rows:
        sk = r.get("snapshot_select_knorm_s")
        print(f"{r['engine']:13s} {r['cache_type']:5s} {'trans' if r['v_trans'] else 'rows':6s} {r['cells']:6d} "
              f"{r['blob_bytes'] / 1e6:6.1f} {1e3 * r['compact_s']:11.2f} {1e3 * r['memcpy_s']:10.3f} "
              f"{r['moved_bytes'] / 1e6:9.1f} {1e3 * r['memcpy_moved_1t_s']:7.2f} {1e3 * r['memcpy_moved_nt_s']:7.2f} "
              f"{r['compact_over_memcpy_moved']:6.2f} {1e3 * r['gather_numpy_1t_s']:10.2f} "
              f"{r['compact_over_gather']:6.2f} {'' if sk is None else f'{1e3 * sk:14.1f}'}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for eng, ct, vt in sorted({(r["engine"], r["cache_type"], r["v_trans"]) for r in rows}):
        rs = [r for r in rows if (r["engine"], r["cache_type"], r["v_trans"]) == (eng, ct, vt)]
        x = [r["cells"] for r in rs]
        lay = "V transposed" if vt else "V rows"
        ax.plot(x, [1e3 * r["compact_s"] for r in rs], marker="o", label=f"{eng} ({ct}, {lay})")
        if eng == "state":
            ax.plot(x, [1e3 * r["memcpy_s"] for r in rs], marker="x", ls=":", label=f"memcpy of blob ({ct}, {lay})")
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
