#!/usr/bin/env python3
"""What a user waits for when a turn fills the cache: the time to the first token of a
chat reply whose turn triggers a compression, against the same turn with room to spare.

    .venv/bin/edgekv bench run stall --length 8192 --cache-types f16,q8_0 --rounds 3

One Session of ``--length + 64`` cells per cache type (a second one for H2O, below) is
prefilled twice with the same real text (recording the observation window and, for Expected Attention, the query
statistics, as a chat does): once to ``--length`` cells, where the turn fits, and once
to 14 cells short of full, where it does not. Then, per round and per method in turn,
each state is restored and one user turn (the chat template's text for a short
question, about 25 tokens) is fed and one token sampled, greedy. The method compresses
one-shot (``scheduled=False``: LagKV's incremental schedule is not asked) under
``--ratio``, so a full cache of ``--length`` cells drops to ``(1 - ratio)`` of them: 8k
to 1k by default. The stall is the difference of the two times (medians over the
rounds); the compression's own time, from the session's counters, is beside it.

A third turn per round starts from the full state too, but first runs
``Session.make_room`` for the turn's tokens, as ``edgekv chat --room`` does after a reply
while the user types: its first token (``ahead s``) shows what is left of the stall once
the compression runs between turns. It must sample the token the full turn sampled
(the same cache, byte for byte: ``tests/test_session.py``).

Methods that tally attention from the sequence's start (H2O) get a Session of their own,
prefilled with the tally on: it would slow every other method's turns, and an H2O chat
pays it on both of its turns, with room and when full.
Writes ``bench/results/stall.json`` (``stall_<model>.json`` for another ``--model``).
``--update`` replaces only the rows of the methods and cache types this run measures and
keeps the others (each row records the command, the commit and the CPU that measured it;
the file's ``machine`` is the latest run's), so a costly method
(KVzip: minutes per round) need not be run again after a change to another.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgekv.llama import Model, SamplerConfig
    from edgekv.methods import Method


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="all", help="comma-separated, or all")
    ap.add_argument("--length", type=int, default=8192, help="cells when the turn arrives")
    ap.add_argument("--ratio", type=float, default=0.875, help="share of the cells the compression removes")
    ap.add_argument("--cache-types", default="f16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--update", action="store_true", help="keep the rows of the results file this run does not measure")
    ap.add_argument("--out", default=None,
                    help="results name (default: stall for the default model, else stall_<model>)")
    a = ap.parse_args()
    if a.length < 256 or not 0 < a.ratio < 1 or a.rounds < 1:
        ap.error("need --length >= 256, 0 < --ratio < 1 and --rounds >= 1")

    from edgekv.bench.results import RESULTS, machine, write_json
    from edgekv.bench.speed import long_text_tokens
    from edgekv.errors import EdgekvError
    from edgekv.llama import Model, SamplerConfig
    from edgekv.methods import METHODS, get_method
    from edgekv.models import resolve_model

    names = list(METHODS) if a.methods == "all" else a.methods.split(",")
    try:  # a name may carry parameters (chunkkv:per_layer=false:chunk=10)
        methods = {m: get_method(m) for m in names}
    except (EdgekvError, ValueError) as e:
        ap.error(str(e))
    names = [m for m in names if methods[m].compresses]
    model = Model(resolve_model(a.model))
    question = model.apply_chat_template([{"role": "user", "content": "What did the letter say about the ball "
                                           "at Netherfield, and who wrote it?"}], add_assistant=True)
    spare = 64
    toks = long_text_tokens(model, a.length + spare - 14)
    greedy = SamplerConfig(temperature=0)
    rows = []
    command = " ".join(["bench/stall.py", *sys.argv[1:]])
    here = machine()
    commit, cpu = here["commit"], here["cpu"]  # per row: --update keeps rows measured at other commits and on other CPUs
    for ct in a.cache_types.split(","):
        for tally in (False, True):  # the tallying methods in a session of their own
            group = [m for m in names if methods[m].tallies == tally]
            if group:
                rows += _measure(a, model, ct, group, methods=methods, tally=tally, toks=toks, question=question,
                                 spare=spare, greedy=greedy, stamp={"command": command, "commit": commit, "cpu": cpu})
    model.close()
    name = a.out or ("stall" if a.model == "smollm2-135m" else f"stall_{Path(a.model).name.removesuffix('.gguf')}")
    if a.update and (RESULTS / f"{name}.json").exists():
        measured = {(r["method"], r["cache_type"]) for r in rows}
        old = json.loads((RESULTS / f"{name}.json").read_text())
        kept = [{"commit": old["machine"].get("commit", "?"), "cpu": old["machine"].get("cpu", "?"), **r}
                for r in old["rows"]
                if (r["method"], r["cache_type"]) not in measured]
        order = {(m, ct): i for i, (m, ct) in enumerate((m, ct) for ct in ("f16", "q8_0", "q4_0") for m in METHODS)}
        rows = sorted(kept + rows, key=lambda r: (order.get((r["method"].split(":")[0], r["cache_type"]), len(order)),
                                                  r["method"]))
    out = write_json(name, {"machine": machine(), "model": a.model, "rows": rows})
    print(f"{'method':18s} {'cache':6s} {'room s':>7s} {'full s':>7s} {'stall s':>8s} {'compress s':>10s} "
          f"{'ahead s':>8s}")
    for row in rows:
        if "refused" in row:
            print(f"{row['method']:18s} {row['cache_type']:6s} refused: {row['refused']}")
            continue
        print(f"{row['method']:18s} {row['cache_type']:6s} {row['first_token_s_room']:7.2f} "
              f"{row['first_token_s_full']:7.2f} {row['stall_s']:8.2f} {row['compress_s']:10.2f} "
              f"{row.get('first_token_s_ahead', float('nan')):8.2f}")
    print(f"wrote {out}")


def _measure(a: argparse.Namespace, model: Model, ct: str, group: list[str], *, methods: dict[str, Method],
             tally: bool, toks: list[int], question: str, spare: int, greedy: SamplerConfig,
             stamp: dict[str, str]) -> list[dict]:
    """One cache type's rows for ``group``: one Session, prefilled to the two states, each
    method's turns taken in alternating order."""
    from edgekv.errors import EdgekvError
    from edgekv.ggml_types import kv_kwargs
    from edgekv.session import Session

    observe = max(methods[m].queries_needed for m in group)
    moments = any(methods[m].query_statistics for m in group)
    rows = []
    with Session(model, method="full", n_ctx=a.length + spare, chunk=512, **kv_kwargs(ct),
                 n_threads=a.threads, observe=observe, moments=moments, tally=tally) as s:
        states = {}
        for kind, n in (("room", a.length), ("full", len(toks))):
            s.reset()
            t0 = time.perf_counter()
            s.feed(toks[:n])
            states[kind] = s.save()
            print(f"{ct}: prefilled {n} cells ({kind}) in {time.perf_counter() - t0:.1f} s", flush=True)
        n_turn = len(model.tokenize(question, add_special=False, parse_special=True))
        assert a.length + n_turn + 1 <= a.length + spare < len(toks) + n_turn  # fits, then does not
        times: dict[str, dict[str, list[float]]] = {m: {"room": [], "full": [], "ahead": [], "compress": []}
                                                   for m in group}
        refused: dict[str, str] = {}
        cells_after: dict[str, int] = {}
        for r in range(a.rounds):
            for m in [m for m in (group if r % 2 == 0 else reversed(group)) if m not in refused]:
                sampled: dict[str, int | None] = {}
                for kind in ("room", "full", "ahead") if r % 2 == 0 else ("ahead", "full", "room"):
                    s.restore(states["full" if kind == "ahead" else kind])
                    try:
                        s.use(m, ratio=a.ratio, scheduled=False)
                    except EdgekvError as e:  # a method this cache or engine cannot run
                        refused[m] = str(e)
                        print(f"{ct} {m}: refused: {e}", flush=True)
                        break
                    if kind == "ahead" and not s.make_room(n_turn):  # between turns: not timed
                        raise SystemExit(f"{m}: make_room did not compress the full cache")
                    before, spent = s.stats.compressions, s.stats.compress_seconds
                    t0 = time.perf_counter()
                    s.feed_text(question, add_special=False)
                    sampled[kind] = s.step(greedy)
                    times[m][kind].append(time.perf_counter() - t0)
                    compressed = s.stats.compressions - before
                    if kind == "full":
                        times[m]["compress"].append(s.stats.compress_seconds - spent)
                        cells_after[m] = s.engine.n_cells
                    if compressed != (kind == "full"):
                        raise SystemExit(f"{m}: the {kind} turn compressed {compressed} times")
                if m in refused:
                    continue
                if sampled["ahead"] != sampled["full"]:
                    raise SystemExit(f"{m}: the turn after make_room sampled {sampled['ahead']}, "
                                     f"the full turn {sampled['full']}")
                print(f"round {r + 1}/{a.rounds} {ct} {m}: first token {times[m]['room'][-1]:.2f} s with room, "
                      f"{times[m]['full'][-1]:.2f} s when full (compression {times[m]['compress'][-1]:.2f} s), "
                      f"{times[m]['ahead'][-1]:.2f} s after making room", flush=True)
        for m, why in refused.items():
            rows.append({"method": m, "cache_type": ct, "length": a.length, "refused": why, **stamp})
        for m in [m for m in group if m not in refused]:
            room, full = statistics.median(times[m]["room"]), statistics.median(times[m]["full"])
            rows.append({"method": m, "cache_type": ct, "length": a.length, "ratio": a.ratio,
                         "cells_after": cells_after[m], "turn_tokens": n_turn,
                         "first_token_s_room": round(room, 3), "first_token_s_full": round(full, 3),
                         "stall_s": round(full - room, 3),
                         "first_token_s_ahead": round(statistics.median(times[m]["ahead"]), 3),
                         "compress_s": round(statistics.median(times[m]["compress"]), 3), "raw": times[m],
                         **stamp})
    return rows


if __name__ == "__main__":
    main()
