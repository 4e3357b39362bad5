#!/usr/bin/env python3
"""What the tensor capture costs: no eval callback, an idle one, and one recording queries.

``Context`` installs ``native/capture.c`` as llama.cpp's eval callback at
creation; while nobody asks for a tensor it answers "not needed" to every
graph node ("idle"). Attention methods (SnapKV, ChunkKV) have the engine
record every layer's post-RoPE queries after each decode ("recording": the
graph is cut at each ``Qcur`` node and the queries are copied to the host and
kept for a window of 64 tokens). This times prefill (1024 tokens, two
512-token decodes) and 48 single-token decodes in the three modes, rotating
their order every round, on the default model (f16, flash attention off,
2 threads), and reports medians.

    .venv/bin/edgekv bench run capture_cost --rounds 8
writes bench/results/capture_cost.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

from edgekv.bench.results import machine, write_json
from edgekv.bench.speed import long_text_tokens
from edgekv.kvcache import StateEngine
from edgekv.llama import Context, Model
from edgekv.models import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    m = Model(resolve_model(None))
    toks = long_text_tokens(m, 1024 + 48)
    modes = ["off", "idle", "recording"]
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in modes}
    for r in range(a.rounds):
        for mode in modes[r % 3:] + modes[: r % 3]:
            ctx = Context(m, n_ctx=1200, n_batch=512, flash_attn="off", n_threads=2, capture=mode != "off")
            assert (ctx.capture is not None) == (mode != "off")
            eng = StateEngine(ctx)
            if mode == "recording":
                eng.observe(64)
            t0 = time.perf_counter()
            for i in range(0, 1024, 512):
                eng.decode(toks[i : i + 512], i)
            prefill = 1024 / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            for j in range(48):
                eng.decode([toks[1024 + j]], 1024 + j)
            decode = 48 / (time.perf_counter() - t0)
            runs[mode].append((prefill, decode))
            ctx.close()
            print(f"round {r + 1} capture {mode}: prefill {prefill:.1f} tok/s, decode {decode:.1f} tok/s", flush=True)
    m.close()
    rows = {mode: {"prefill_tok_s": round(statistics.median(x[0] for x in v), 1),
                   "decode_tok_s": round(statistics.median(x[1] for x in v), 1),
                   "runs": [[round(p, 1), round(d, 1)] for p, d in v]}
            for mode, v in runs.items()}
    # the machine's speed drifts between rounds: compare each mode with "off" of the same round
    for mode in ("idle", "recording"):
        for j, what in enumerate(("prefill", "decode")):
            ratios = [x[j] / o[j] for x, o in zip(runs[mode], runs["off"], strict=True)]
            rows[mode][f"{what}_vs_off"] = round(statistics.median(ratios), 3)
    for mode in modes:
        print(mode, rows[mode])
    print(f"wrote {write_json('capture_cost', {'machine': machine(), 'rounds': a.rounds, 'rows': rows})}")


if __name__ == "__main__":
    main()
