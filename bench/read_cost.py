#!/usr/bin/env python3
"""What reading K and V back to the host costs (the native engine's
``llama_edgekv_seq_read``): the host path (a cache in host memory, converted
straight into the caller's array) against the ggml graph GPUs run
(``EDGEKV_GRAPH_OPS=1``), and pooled output buffers against fresh ones.

    .venv/bin/edgekv bench run read_cost --tokens 2048 --layers 20 --repeat 9

A session of ``--tokens`` tokens through a 1024-cell LagKV cache, then
``--layers`` layers read at once, K alone and V alone, for flash attention off
(V transposed) and on (V in rows). Interleaved, ``--repeat`` rounds, medians.
"fresh" gives each read a new buffer and holds on to it until the end, so
every read lands on new pages, as reads did before the engine pooled its
buffers; "pooled" releases each read's arrays, so the engine's pool hands the
same buffers out again. Writes
``bench/results/read_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "read_cost.json")
    a = ap.parse_args()

    from edgekv.bench.speed import long_text_tokens
    from edgekv.kvcache.native import ReadBuffers
    from edgekv.llama import Model
    from edgekv.models import resolve_model
    from edgekv.session import Session

    model = Model(resolve_model(a.model))
    toks = long_text_tokens(model, a.tokens)
    rows = []
    for fa in ("off", "on"):
        with Session(model, method="lagkv", chunk=256, budget=1024, n_ctx=1280, flash_attn=fa) as s:
            s.feed(toks)
            eng = s.engine
            layers = range(min(a.layers, eng.n_layer))
            cases = [(path, what, bufs) for path in ("host", "graph") for what in ("K", "V")
                     for bufs in ("pooled", "fresh")]
            times: dict[tuple[str, str, str], list[float]] = {c: [] for c in cases}
            held = []
            pooled = eng._buffers
            for _ in range(a.repeat):
                for path, what, bufs in cases:
                    os.environ["EDGEKV_GRAPH_OPS"] = "1" if path == "graph" else "0"
                    eng._buffers = pooled if bufs == "pooled" else ReadBuffers(0)  # cap 0: every buffer new
                    t = time.perf_counter()
                    out = eng.read(layers, cell_order=True, keys=what == "K", values=what == "V")
                    times[(path, what, bufs)].append(time.perf_counter() - t)
                    if bufs == "fresh":
                        held.append(out)  # kept until the end: no read can reuse its pages
                    del out
            held.clear()
            os.environ.pop("EDGEKV_GRAPH_OPS", None)
            eng._buffers = pooled
            mib = len(layers) * eng.n_kv_head * eng.n_cells * eng.head_dim_k * 4 / 2**20
            for (path, what, bufs), ts in times.items():
                ms = 1000 * statistics.median(ts)
                rows.append({"model": a.model, "flash_attn": fa, "v_transposed": fa == "off", "cells": eng.n_cells,
                             "layers": len(layers), "what": what, "path": path, "buffers": bufs,
                             "ms": round(ms, 2), "mib": round(mib, 1), "gib_s": round(mib / 1024 / (ms / 1000), 2)})
                print(f"fa={fa} {what} {path:5s} {bufs:6s}: {ms:6.1f} ms for {mib:.1f} MiB of float32")
    model.close()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
