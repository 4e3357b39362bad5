#!/usr/bin/env python3
"""What one LagKV shrink costs on the native engine: ``select`` on the same snapshot,
repeated, and the score op (``llama_edgekv_seq_lag_scores``) inside it, medians.

A stream of ``--tokens`` tokens goes through a ``--budget``-cell cache (LagKV's budget
mode, 256-token chunks), then ``select`` takes the cache 100 cells below what it holds,
which re-ranks every survivor of every compressed partition: the shrink an ingest runs at
each compression. Each run appends one JSON line (with a hash of the installed libllama)
to ``--out``, so two builds of the patch set can be compared by swapping wheels between
runs, alternating:

    for i in 1 2 3; do for k in OLD_KEY NEW_KEY; do
      .venv/bin/python -m pip install -q --force-reinstall --no-deps ~/.cache/edgekv/wheels/$k/*.whl
      .venv/bin/edgekv bench run lag_shrink
    done; done
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path

from edgekv.bench.results import RESULTS, machine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=RESULTS / "lag_shrink.jsonl")
    a = ap.parse_args()

    import llama_cpp

    from edgekv.bench.speed import long_text_tokens
    from edgekv.llama import Model
    from edgekv.models import resolve_model
    from edgekv.session import Session

    lib = next(Path(llama_cpp.__file__).parent.glob("lib/libllama.so"))
    build = hashlib.sha256(lib.read_bytes()).hexdigest()[:12]
    model = Model(resolve_model(a.model))
    toks = long_text_tokens(model, a.tokens)
    op: list[float] = []
    sel: list[float] = []
    with Session(model, method="lagkv", chunk=256, budget=a.budget, n_ctx=a.budget + 256) as sess:
        sess.feed(toks)
        engine, real = sess.engine, sess.engine.lag_scores

        def timed(members):
            t0 = time.perf_counter()
            try:
                return real(members)
            finally:
                op.append(time.perf_counter() - t0)

        engine.lag_scores = timed  # the snapshot's scorer calls the engine's
        snap = engine.snapshot()
        for _ in range(a.reps):
            t0 = time.perf_counter()
            sess.method.select(snap, snap.n_cells - 100)
            sel.append(time.perf_counter() - t0)
    if not op:
        raise SystemExit("the shrink never reached the score op (a rotated cache, or the state engine?)")
    row = {"model": a.model, "tokens": a.tokens, "budget": a.budget, "reps": a.reps, "libllama": build,
           "cells": snap.n_cells, "select_ms": round(1000 * statistics.median(sel), 2),
           "op_ms": round(1000 * statistics.median(op), 2), "op_calls": len(op), "machine": machine()}
    print(json.dumps(row))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    model.close()


if __name__ == "__main__":
    main()
