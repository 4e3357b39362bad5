#!/usr/bin/env python3
"""Two ways to hold K conversations on one loaded model, side by side in one process:

- ``contexts``: one llama.cpp context per conversation (what ``edgekv serve`` does):
  K contexts of C cells, each decoding its own conversation's token;
- ``streams``: one context with K sequences, each in a KV stream of its own
  (``n_seq_max = K``, ``kv_unified = false``, K x C cells), the K conversations'
  tokens decoded together in one batch.

Memory: resident-set growth when each setup is created and every conversation has
prefilled P tokens (the weights are shared and not counted). Throughput: decode
rounds (one token per conversation), the two setups interleaved, median over the
rounds. The ratio is the case for batching across conversations; what the server
would lose with it is in docs/server.md.

    .venv/bin/edgekv bench run server_modes --conversations 4 --cells 1280 --prefill 512
writes bench/results/server_modes.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--cells", type=int, default=1280)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-type", default="f16")
    ap.add_argument("--out", default="server_modes")
    a = ap.parse_args()

    from edgekv.bench.results import machine, write_json
    from edgekv.bench.speed import long_text_tokens, proc_status
    from edgekv.llama import Context, Model, lib
    from edgekv.models import resolve_model

    L = lib()
    k, cells = a.conversations, a.cells
    model = Model(resolve_model(a.model))
    text = long_text_tokens(model, a.prefill * k + 1)
    prompts = [text[i * a.prefill : (i + 1) * a.prefill] for i in range(k)]
    kw = dict(n_batch=256, cache_type_k=a.cache_type, cache_type_v=a.cache_type, n_threads=a.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    # one context made and used first, so that neither setup pays the one-time costs (threads,
    # backend initialisation) in its figure
    warm = Context(model, n_ctx=cells, **kw)
    warm.decode(prompts[0][:256], 0)
    warm.close()

    # -- one context per conversation
    r0 = proc_status("VmRSS")
    ctxs = [Context(model, n_ctx=cells, **kw) for _ in range(k)]
    for ctx, p in zip(ctxs, prompts, strict=True):
        for i in range(0, len(p), 256):
            ctx.decode(p[i : i + 256], i)
    contexts_mib = proc_status("VmRSS") - r0
    log(f"contexts: {k} x {cells} cells, +{contexts_mib:.0f} MiB")

    # -- one context, one stream per conversation
    r0 = proc_status("VmRSS")
    multi = Context(model, n_ctx=cells * k, n_seq_max=k, **kw)
    for s, p in enumerate(prompts):
        for i in range(0, len(p), 256):
            multi.decode(p[i : i + 256], i, seq=s)
    streams_mib = proc_status("VmRSS") - r0
    log(f"streams: 1 context, {k} streams of {cells} cells, +{streams_mib:.0f} MiB")

    batch = L.llama_batch_init(k, 0, 1)
    nxt = [p[-1] for p in prompts]

    def round_contexts(pos: int) -> float:
        t = time.perf_counter()
        for ctx, tok in zip(ctxs, nxt, strict=True):
            ctx.decode([tok], pos)
        return time.perf_counter() - t

    def round_streams(pos: int) -> float:
        t = time.perf_counter()
        batch.n_tokens = k
        for s, tok in enumerate(nxt):
            batch.token[s] = tok
            batch.pos[s] = pos
            batch.n_seq_id[s] = 1
            batch.seq_id[s][0] = s
            batch.logits[s] = True
        if L.llama_decode(multi.ptr, batch) != 0:
            raise SystemExit("batched decode failed")
        return time.perf_counter() - t

    times: dict[str, list[float]] = {"contexts": [], "streams": []}
    for r in range(a.rounds):  # interleaved, alternating which goes first
        pos = a.prefill + r
        order = (("contexts", round_contexts), ("streams", round_streams))
        for name, fn in order if r % 2 == 0 else order[::-1]:
            times[name].append(fn(pos))
    L.llama_batch_free(batch)
    tok_s = {name: k / statistics.median(v) for name, v in times.items()}
    log(f"decode, {k} conversations: contexts {tok_s['contexts']:.1f} tok/s, streams {tok_s['streams']:.1f} tok/s "
        f"({tok_s['streams'] / tok_s['contexts']:.2f}x)")
    out = write_json(a.out, {
        "machine": machine(), "command": " ".join(["bench/server_modes.py", *sys.argv[1:]]),
        "model": a.model, "conversations": k, "cells": cells, "prefill": a.prefill, "cache_type": a.cache_type,
        "rounds": a.rounds,
        "memory_mib": {"contexts": round(contexts_mib, 1), "streams": round(streams_mib, 1)},
        "decode_tok_s": {n: round(v, 2) for n, v in tok_s.items()},
        "decode_ratio_streams_over_contexts": round(tok_s["streams"] / tok_s["contexts"], 3),
    })
    log(str(out))
    for ctx in ctxs:
        ctx.close()
    multi.close()


if __name__ == "__main__":
    main()
