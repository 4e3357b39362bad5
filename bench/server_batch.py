#!/usr/bin/env python3
"""The server's two ways to decode K live conversations, through the Sessions its worker drives:

- ``contexts``: one Session per conversation, each in a context of its own (``edgekv serve``);
- ``lanes``: K Sessions on one shared context (``edgekv serve --batch``, ``edgekv.lanes``):
  each step queues every conversation's token and one ``llama_decode`` decodes them all.

Every conversation prefills P tokens of text, then the two setups take turns, round for round
(alternating which goes first): a round is one ``step`` per conversation, round-robin as the
server's worker takes its turns, sampling included, until every token of the round is in its
cache. Throughput is K tokens over the round's time; the ratio is the median of the per-round
ratios, and the ratio of all rounds' times. With a compressing method and a --cells below P +
rounds, the rounds include the compressions each setup's engine runs (the native engine for
contexts of their own, the state engine for lanes).

    .venv/bin/edgekv bench run server_batch --conversations 4 --cells 1280 --prefill 512
    .venv/bin/edgekv bench run server_batch --conversations 4 --cells 544 --budget 448 --prefill 512 \
        --method knorm --out server_batch_knorm
write bench/results/server_batch.json and server_batch_knorm.json (and so on for lagkv, snapkv).
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
    ap.add_argument("--method", default="full")
    ap.add_argument("--budget", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-type", default="f16")
    ap.add_argument("--out", default="server_batch")
    a = ap.parse_args()

    from edgekv.bench.results import machine, write_json
    from edgekv.bench.speed import long_text_tokens
    from edgekv.config import BudgetRule, ContextOptions
    from edgekv.lanes import Lanes
    from edgekv.llama import Model, SamplerConfig
    from edgekv.models import resolve_model
    from edgekv.session import Session

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    k = a.conversations
    model = Model(resolve_model(a.model))
    text = long_text_tokens(model, a.prefill * k)
    prompts = [text[i * a.prefill : (i + 1) * a.prefill] for i in range(k)]
    opts = ContextOptions(a.cache_type, a.cache_type, n_threads=a.threads, chunk=256)
    rule = BudgetRule.make(a.method, budget=a.budget, n_ctx=a.cells, chunk=opts.chunk)
    greedy = SamplerConfig()

    def prefilled(make) -> list[Session]:
        sessions = [make() for _ in range(k)]
        for sess, p in zip(sessions, prompts, strict=True):
            sess.feed(p)
        return sessions

    Session(model, options=opts, rule=rule).close()  # one-time costs (threads, backend) paid before either
    contexts = prefilled(lambda: Session(model, options=opts, rule=rule))
    per_cell = contexts[0].stats.kv_bytes_per_cell
    # KV memory as allocated (llama.cpp rounds a context's cells up); resident-set growth is no
    # measure here, the second setup reusing pages the first one's warm-up freed
    kv_mib = {"contexts": sum(s.ctx.n_ctx for s in contexts) * per_cell / 2**20}
    log(f"contexts: {k} sessions of {a.cells} cells ({contexts[0].engine.name} engine), KV {kv_mib['contexts']:.1f} MiB")
    lanes = Lanes(model, k, a.cells, opts)
    batched = prefilled(lambda: Session(model, options=opts, rule=rule, lanes=lanes))
    kv_mib["lanes"] = lanes.ctx.n_ctx * per_cell / 2**20
    log(f"lanes: 1 context of {k} sequences of {lanes.cells} cells (state engine), KV {kv_mib['lanes']:.1f} MiB")

    def round_of(sessions: list[Session]) -> float:
        t = time.perf_counter()
        for sess in sessions:
            if sess.step(greedy) is None:
                raise SystemExit("a conversation ended (end of generation): use a longer --prefill text")
        for sess in sessions:
            sess.settle()  # a lane's queued token: the round ends with every token in its cache
        return time.perf_counter() - t

    times: dict[str, list[float]] = {"contexts": [], "lanes": []}
    for r in range(a.rounds):  # interleaved, alternating which goes first
        order = (("contexts", contexts), ("lanes", batched))
        for name, sessions in order if r % 2 == 0 else order[::-1]:
            times[name].append(round_of(sessions))
    tok_s = {name: k / statistics.median(v) for name, v in times.items()}
    ratio = statistics.median(c / b for c, b in zip(times["contexts"], times["lanes"], strict=True))
    compressions = {name: sum(s.stats.compressions for s in ss) for name, ss in (("contexts", contexts),
                                                                                 ("lanes", batched))}
    log(f"decode, {k} conversations, {a.method}: contexts {tok_s['contexts']:.1f} tok/s, lanes "
        f"{tok_s['lanes']:.1f} tok/s, lanes/contexts {ratio:.3f} (median of per-round ratios), "
        f"{sum(times['contexts']) / sum(times['lanes']):.3f} (all rounds); "
        f"compressions {compressions}")
    out = write_json(a.out, {
        "machine": machine(), "command": " ".join(["bench/server_batch.py", *sys.argv[1:]]),
        "model": a.model, "conversations": k, "cells": a.cells, "prefill": a.prefill, "cache_type": a.cache_type,
        "method": a.method, "budget": a.budget, "rounds": a.rounds, "threads": a.threads,
        "engines": {"contexts": contexts[0].engine.name, "lanes": batched[0].engine.name},
        "kv_allocated_mib": {n: round(v, 2) for n, v in kv_mib.items()},
        "decode_tok_s": {n: round(v, 2) for n, v in tok_s.items()},
        "round_s_median": {n: round(statistics.median(v), 4) for n, v in times.items()},
        "ratio_lanes_over_contexts": round(ratio, 3),
        # every round counted, the compressions' included
        "total_s": {n: round(sum(v), 3) for n, v in times.items()},
        "ratio_of_totals": round(sum(times["contexts"]) / sum(times["lanes"]), 3),
        "compressions": compressions,
        "batched_steps": lanes.steps, "batched_tokens": lanes.tokens,
    })
    log(str(out))
    for sess in contexts + batched:
        sess.close()
    lanes.close()


if __name__ == "__main__":
    main()
