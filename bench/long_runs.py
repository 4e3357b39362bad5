#!/usr/bin/env python3
"""Long runs on one Session: a scripted chat of many turns, or one long generation, with the
cells, the resident memory and the Python heap sampled as they go.

Each run checks, and fails (exit 1) unless:

- the cells stay within the context, and the sinks and the recent window are never
  evicted (checked on the cache itself every ``--check-every`` steps);
- memory is flat after warm-up (``edgekv.bench.drift``: the fitted slope of RSS and of
  the Python heap (traced) over the last 90 % of the run below 1 % of the warm RSS per 1000
  turns or tokens; a run too short to judge says so);
- greedy is deterministic: with ``--repeat N`` the first N steps run again in a fresh
  session and must give the same text.

    .venv/bin/python bench/long_runs.py chat --method lagkv --turns 1000
    .venv/bin/python bench/long_runs.py generate --method lagkv --tokens 5000

write bench/results/long_runs/<mode>_<method>.json and a plot beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import tracemalloc
from pathlib import Path

QUESTIONS = ["What did the keeper see from the lighthouse today?", "Which ship came in last, and from where?",
             "Summarise the weather in one sentence.", "What should the keeper repair next?",
             "Name one thing the crew said.", "How long is the night watch?"]


class Transcript:
    """What a run wrote: a SHA-256 of all of it and its first ``keep`` pieces (the repeat
    check's). Nothing more is kept, so the run's own memory does not grow with its text:
    the heap then measures what edgekv keeps (a chat's messages, by design)."""

    def __init__(self, keep: int) -> None:
        self.keep, self.head, self.n = keep, [], 0
        self._sha = hashlib.sha256()

    def add(self, piece: str) -> None:
        self._sha.update((b"\x1e" if self.n else b"") + piece.encode())
        self.n += 1
        if len(self.head) < self.keep:
            self.head.append(piece)

    def sha256(self) -> str:
        return self._sha.hexdigest()


def protected_kept(session, method) -> bool:
    """Every (layer, KV head) still holds the sinks and the recent window."""
    snap = session.engine.snapshot()
    tp = snap.token_pos
    newest = int(tp.max())
    want = [*range(min(method.sinks, newest + 1)), *range(max(0, newest + 1 - method.window), newest + 1)]
    return all(bool((tp == p).any(axis=-1).all()) for p in want)


def chat_run(model, a, turns: int, out: Transcript, drift=None) -> tuple[list[str], int]:
    """The scripted chat, its replies into ``out``: (problems, compressions)."""
    from edgekv.llama import SamplerConfig
    from edgekv.session import Chat, Session

    problems: list[str] = []
    with Session(model, method=a.method, budget=a.budget, n_ctx=a.n_ctx, n_threads=a.threads) as s:
        chat = Chat(s, system="You are the lighthouse keeper's assistant. Answer briefly.")
        for t in range(turns):
            q = f"{QUESTIONS[t % len(QUESTIONS)]} (turn {t + 1})"
            out.add("".join(chat.send(q, max_tokens=a.max_tokens, sampler=SamplerConfig(temperature=0))))
            cells = s.engine.n_cells
            if cells > a.n_ctx:
                problems.append(f"turn {t + 1}: {cells} cells in a context of {a.n_ctx}")
            if drift is not None:
                if (t + 1) % a.check_every == 0 and not protected_kept(s, s.method):
                    problems.append(f"turn {t + 1}: a sink or a window token was evicted")
                if (t + 1) % a.sample_every == 0 or t == 0:
                    drift.add(t + 1, cells)
                if (t + 1) % 50 == 0:
                    print(f"turn {t + 1}/{turns}: {cells} cells, {s.stats.compressions} compressions, "
                          f"RSS {drift.samples[-1][1]:.0f} MiB", file=sys.stderr, flush=True)
        return problems, s.stats.compressions


def generate_run(model, a, tokens: int, out: Transcript, drift=None) -> tuple[list[str], int]:
    """One long generation, its text into ``out`` in pieces of --sample-every tokens:
    (problems, compressions)."""
    from edgekv.llama import SamplerConfig
    from edgekv.session import Session

    problems: list[str] = []
    with Session(model, method=a.method, budget=a.budget, n_ctx=a.n_ctx, n_threads=a.threads) as s:
        s.feed_text(s.model.apply_chat_template(
            [{"role": "user", "content": "Write a very long story about a lighthouse keeper and the ships "
                                         "she sees, one day after another. Never stop."}], add_assistant=True))
        buf: list[bytes] = []
        n = 0
        for tok in s.generate_tokens(tokens, SamplerConfig(temperature=0)):
            buf.append(s.model.piece(tok))
            n += 1
            cells = s.engine.n_cells
            if cells > a.n_ctx:
                problems.append(f"token {n}: {cells} cells in a context of {a.n_ctx}")
            if n % a.sample_every == 0:
                out.add(b"".join(buf).decode(errors="replace"))
                buf.clear()
                if drift is not None:
                    drift.add(n, cells)
                    if n % (a.sample_every * a.check_every) == 0 and not protected_kept(s, s.method):
                        problems.append(f"token {n}: a sink or a window token was evicted")
            if n % 500 == 0:
                print(f"token {n}/{tokens}: {cells} cells, {s.stats.compressions} compressions",
                      file=sys.stderr, flush=True)
        out.add(b"".join(buf).decode(errors="replace"))
        if n < tokens:
            problems.append(f"the generation ended after {n} of {tokens} tokens")
        return problems, s.stats.compressions


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["chat", "generate"])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="lagkv")
    ap.add_argument("--budget", type=int, default=320)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--turns", type=int, default=1000, help="chat: turns")
    ap.add_argument("--tokens", type=int, default=5000, help="generate: tokens")
    ap.add_argument("--max-tokens", type=int, default=24, help="chat: longest reply")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sample-every", type=int, default=5, help="turns (chat) or tokens (generate) per sample")
    ap.add_argument("--check-every", type=int, default=10, help="samples between checks of the sinks and window")
    ap.add_argument("--repeat", type=int, default=0, help="rerun the first N turns/tokens: greedy must repeat")
    ap.add_argument("--json", default=None, help="write the result here (default: bench/results/long_runs/)")
    a = ap.parse_args()

    from edgekv.bench.drift import Drift
    from edgekv.bench.results import RESULTS, machine
    from edgekv.llama import Model
    from edgekv.models import resolve_model

    model = Model(resolve_model(a.model))
    tracemalloc.start()  # the Python heap, traced from here on (edgekv.bench.drift)
    steps = a.turns if a.mode == "chat" else a.tokens
    run = chat_run if a.mode == "chat" else generate_run
    if a.mode == "generate":
        a.sample_every = max(a.sample_every, 25)
    drift = Drift(unit="turn" if a.mode == "chat" else "token", min_steps=200 if a.mode == "chat" else 2000)
    k = min(a.repeat, steps)
    n = k if a.mode == "chat" else k // a.sample_every  # pieces the repeat compares
    out = Transcript(keep=n)
    t0 = time.perf_counter()
    problems, compressions = run(model, a, steps, out, drift)
    wall = time.perf_counter() - t0
    repeat = None
    if a.repeat:
        again = Transcript(keep=n)
        run(model, a, k, again)
        repeat = {"steps": k, "same": again.head == out.head}
        if not repeat["same"]:
            problems.append(f"greedy did not repeat over the first {k} {drift.unit}s")
    verdict = drift.verdict()
    if verdict["flat"] is False:
        problems.append(str(verdict["why"]))
    name = f"{a.mode}_{a.method}"
    result = {"machine": machine(), "command": " ".join(["bench/long_runs.py", *sys.argv[1:]]),
              "config": {k: v for k, v in vars(a).items() if k != "json"}, "wall_s": round(wall, 1),
              "steps": steps, "compressions": compressions, "text_sha256": out.sha256(),
              "repeat": repeat, "drift": verdict, "series": drift.series(), "problems": problems,
              "ok": not problems}
    if a.json:
        path = Path(a.json)
    else:
        path = RESULTS / "long_runs" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        drift.plot(path.with_suffix(".png"), f"{a.mode}, {a.method} budget {a.budget}, n_ctx {a.n_ctx}, "
                                             f"{model.path.name}")
    path.write_text(json.dumps(result, indent=1) + "\n")
    rss, heap = verdict["rss_mib"], verdict["heap_mib"]
    print(f"{name}: {steps} {drift.unit}s in {wall:.0f} s; cells <= {verdict['max_cells']}; RSS {rss['warm']} -> "
          f"{rss['end']} MiB ({rss['slope_pct_of_warm_rss_per_1000']} % per 1000), Python heap {heap['warm']} -> "
          f"{heap['end']} MiB ({heap['slope_pct_of_warm_rss_per_1000']} % of the warm RSS per 1000): "
          f"{verdict['why']}"
          + (f"; greedy repeats: {repeat['same']}" if repeat else "")
          + ("; ok" if not problems else "; FAILED: " + "; ".join(problems[:5])))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
