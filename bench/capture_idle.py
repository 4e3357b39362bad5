#!/usr/bin/env python3
"""What the idle tensor capture costs: contexts with and without edgekv's eval callback.

``Context`` installs ``native/capture.c`` as llama.cpp's eval callback at
creation; while nobody asks for a tensor it answers "not needed" to every
graph node. This times prefill (1024 tokens) and 48 single-token decodes with
and without it, alternating, on the default model (f16, flash attention off,
2 threads), and reports medians.

    .venv/bin/python bench/capture_idle.py --rounds 8
writes bench/results/capture_idle.json.
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
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for r in range(a.rounds):
        for cap in (True, False) if r % 2 == 0 else (False, True):
            ctx = Context(m, n_ctx=1200, n_batch=512, flash_attn="off", n_threads=2, capture=cap)
            assert (ctx.capture is not None) == cap
            eng = StateEngine(ctx)
            t0 = time.perf_counter()
            for i in range(0, 1024, 512):
                eng.decode(toks[i : i + 512], i)
            prefill = 1024 / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            for j in range(48):
                eng.decode([toks[1024 + j]], 1024 + j)
            decode = 48 / (time.perf_counter() - t0)
            runs[cap].append((prefill, decode))
            ctx.close()
            print(f"round {r + 1} capture {'on ' if cap else 'off'}: prefill {prefill:.1f} tok/s, "
                  f"decode {decode:.1f} tok/s", flush=True)
    m.close()
    rows = {("on" if cap else "off"): {"prefill_tok_s": round(statistics.median(x[0] for x in v), 1),
                                        "decode_tok_s": round(statistics.median(x[1] for x in v), 1),
                                        "runs": [[round(p, 1), round(d, 1)] for p, d in v]}
            for cap, v in runs.items()}
    print(rows["off"], rows["on"], sep="\n")
    print(f"wrote {write_json('capture_idle', {'machine': machine(), 'rounds': a.rounds, 'rows': rows})}")


if __name__ == "__main__":
    main()
