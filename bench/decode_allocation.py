#!/usr/bin/env python3
"""Why a compressed cache decodes slower than a fresh context of as many cells:
the compression, or the allocation it lives in?

Three sessions decode in alternating blocks of 8 tokens (greedy, the model's
own tokens fed back), medians over rounds:

- compressed: ``--length`` tokens prefilled into an n_ctx of that length, then
  compressed (``--method``) to ``--cells`` cells, as ``edgekv bench speed`` does;
- same allocation: ``--cells`` tokens prefilled into the same large n_ctx,
  never compressed;
- fresh: ``--cells`` tokens prefilled into an n_ctx just large enough;
- moved: the compressed cache restored into a context as small as fresh's
  (what a session that moved to a context of its size would decode at);
- restored: the compressed cache restored into a new context as large as
  compressed's (the layout it was left in, without the context's history).

If "same allocation" decodes like "compressed", the gap to "fresh" is the
allocation (strides of the cache tensors, a transposed V's rows ``n_ctx``
cells apart), not what compression leaves behind; "moved" then decodes like
"fresh". ``--cache-type`` and ``--flash-attn`` choose the layout: f16 with
flash attention off (edgekv's CPU default) holds V transposed, a quantised V
needs flash attention and holds V in rows like K.

    .venv/bin/edgekv bench run decode_allocation --length 8192 --cells 1024 --method knorm --cache-type q8_0

appends one JSON line to bench/results/decode_allocation.jsonl (``--out``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--cells", type=int, default=1024)
    ap.add_argument("--method", default="knorm")
    ap.add_argument("--tokens", type=int, default=64, help="decoded per session per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-type", default="f16", help="K and V cache type")
    ap.add_argument("--flash-attn", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/decode_allocation.jsonl"))
    a = ap.parse_args()

    from edgekv.bench.results import machine
    from edgekv.bench.speed import decode_rate, long_text_tokens
    from edgekv.llama import Model
    from edgekv.models import resolve_model
    from edgekv.session import Session

    model = Model(resolve_model(a.model))
    toks = long_text_tokens(model, a.length)
    room = a.tokens * a.rounds + 16
    big = a.length + room
    kw = dict(n_threads=a.threads, chunk=512, cache_type_k=a.cache_type, cache_type_v=a.cache_type,
              flash_attn=a.flash_attn)
    comp = Session(model, method="full", n_ctx=big, **kw)
    comp.feed(toks)
    comp.use(a.method, scheduled=False)  # one-shot: LagKV's own schedule would compress during the decode
    comp.compress(a.cells)
    same = Session(model, method="full", n_ctx=big, **kw)
    same.feed(toks[:a.cells])
    fresh = Session(model, method="full", n_ctx=a.cells + room, **kw)
    fresh.feed(toks[:a.cells])
    saved, nxt = comp.save(), int(np.argmax(comp.logits()))
    moved = Session(model, method="full", n_ctx=a.cells + room, **kw)
    restored = Session(model, method="full", n_ctx=big, **kw)
    for s in (moved, restored):
        s.restore(saved)
        s.feed([nxt])  # a restore keeps no logits: one token, the one comp decodes next
    sessions = {"compressed": comp, "same allocation": same, "fresh": fresh, "moved": moved, "restored": restored}
    print("; ".join(f"{k}: {s.engine.n_cells} cells in n_ctx {s.ctx.n_ctx}" for k, s in sessions.items())
          + f"; flash attention {comp.ctx.flash_attn}", flush=True)
    secs: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(a.rounds):
        t = dict.fromkeys(sessions, 0.0)
        for _ in range(0, a.tokens, 8):
            for k, s in sessions.items():
                t[k] += 8 / decode_rate(s, 8)  # greedy tokens fed back; decode_rate returns tok/s
        for k in sessions:
            secs[k].append(t[k])
    out = {k: round(a.tokens / float(np.median(v)), 2) for k, v in secs.items()}
    here = machine()
    row = json.dumps({"model": a.model, "length": a.length, "cells": a.cells, "method": a.method,
                      "cache_type": a.cache_type, "flash_attn": comp.ctx.flash_attn,
                      "tokens": a.tokens, "rounds": a.rounds, "tok_s": out,
                      "fresh_ratio": {k: round(v / out["fresh"], 3) for k, v in out.items()},
                      "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": here["commit"], "cpu": here["cpu"]})
    print(row)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "a") as f:
        f.write(row + "\n")
    for s in sessions.values():
        s.close()
    model.close()


if __name__ == "__main__":
    main()
