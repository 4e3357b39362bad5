#!/usr/bin/env python3
"""What the observation-window scores cost (the native engine's
``llama_edgekv_seq_score``, which SnapKV, ChunkKV, CompressKV and ProtoKV read):
the host kernel in the cache's memory (x86-64 with AVX2 and FMA; its AVX-512 pass where
the CPU has it, and its AVX2 pass forced with ``EDGEKV_CPU=avx2``) against the ggml
graph GPUs and other CPUs run (``EDGEKV_GRAPH_OPS=1``).

    .venv/bin/edgekv bench run score_cost --tokens 8192 --queries 64 --repeat 5

A full cache of ``--tokens`` cells per cache type (F16 with V transposed, Q8_0
with flash attention), then every layer scored against the last ``--queries``
queries, each path in turn, ``--repeat`` rounds, medians; beside each, the
largest difference from the graph's scores. Writes ``bench/results/score_cost.json``
(``--out NAME``: NAME.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# the environment each path runs under: EDGEKV_GRAPH_OPS, and EDGEKV_CPU for the host kernel's pass
PATHS = {"host": {"EDGEKV_GRAPH_OPS": "0"}, "host-avx2": {"EDGEKV_GRAPH_OPS": "0", "EDGEKV_CPU": "avx2"},
         "graph": {"EDGEKV_GRAPH_OPS": "1"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--cache-types", default="f16,q8_0")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="score_cost", help="results name: bench/results/OUT.json")
    a = ap.parse_args()

    import numpy as np

    from edgekv.bench.results import machine, write_json
    from edgekv.bench.speed import long_text_tokens
    from edgekv.llama import Model
    from edgekv.models import resolve_model
    from edgekv.session import Session

    model = Model(resolve_model(a.model))
    toks = long_text_tokens(model, a.tokens)
    rows = []
    for ct in a.cache_types.split(","):
        with Session(model, method="full", n_ctx=a.tokens + 64, chunk=512, cache_type_k=ct, cache_type_v=ct,
                     n_threads=a.threads, observe=a.queries, engine="native") as s:
            s.feed(toks)
            eng = s.engine
            q, q_pos = eng.window.last(a.queries)
            times: dict[str, list[float]] = {p: [] for p in PATHS}
            scores: dict[str, np.ndarray] = {}
            for _ in range(a.repeat):
                for path, env in PATHS.items():
                    os.environ.update(env)
                    t = time.perf_counter()
                    scores[path] = eng.score(q, q_pos)
                    times[path].append(time.perf_counter() - t)
                    for name in env:
                        os.environ.pop(name)
            for path, ts in times.items():
                diff = float(np.abs(scores[path] - scores["graph"]).max())
                rows.append({"model": a.model, "cache_type": ct, "flash_attn": s.ctx.flash_attn,
                             "cells": eng.n_cells, "queries": a.queries, "layers": eng.n_layer, "path": path,
                             "s": round(statistics.median(ts), 4), "max_abs_diff_from_graph": diff,
                             "raw": [round(t, 4) for t in ts]})
                print(f"{ct} {path:13s}: {statistics.median(ts):6.3f} s for {eng.n_cells} cells x {a.queries} "
                      f"queries x {eng.n_layer} layers (largest difference from the graph {diff:.2e})", flush=True)
    model.close()
    print(f"wrote {write_json(a.out, {'machine': machine(), 'args': vars(a), 'rows': rows})}")


if __name__ == "__main__":
    main()
