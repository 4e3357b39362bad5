#!/usr/bin/env python3
"""Passkey retrieval accuracy against kept fraction, per method, on one model.

Protocol (query-agnostic, as in a chat): the haystack with the passkey is
prefilled once per sample, the cache is compressed to the kept fraction, and
only then does the question arrive. Each sample is prefilled once and its
sequence state restored for every (method, fraction).

    .venv/bin/edgekv bench run passkey --n 10 --tokens 1500
writes bench/results/passkey.json and passkey.png.
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

from edgekv.bench import protocol
from edgekv.bench.results import RESULTS, machine, write_json

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
QUESTION = "\nWhat is the pass key? The pass key is"


def make_sample(model, n_tokens: int, rng: random.Random) -> tuple[str, str]:
    """A haystack of about n_tokens tokens with a 5-digit passkey at a random depth."""
    key = str(rng.randint(10000, 99999))
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    per = len(model.tokenize(FILLER, add_special=False))
    n_fill = max(2, (n_tokens - 60) // per)
    at = rng.randint(1, n_fill - 1)
    text = INTRO + FILLER * at + needle + FILLER * (n_fill - at)
    return text, key


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path or registry name (default smollm2-135m)")
    ap.add_argument("--methods", default="full,streaming_llm,knorm,random")
    ap.add_argument("--kept", default="0.5,0.25,0.125", help="kept fractions (fraction of prompt cells kept)")
    ap.add_argument("--n", type=int, default=10, help="samples")
    ap.add_argument("--tokens", type=int, default=1500, help="haystack length in tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-type", default="f16")
    ap.add_argument("--out", default="passkey")
    a = ap.parse_args()

    from rich.progress import Progress

    from edgekv.models import resolve_model
    from edgekv.session import Session

    path = resolve_model(a.model)
    sess = Session(path, method="full", n_ctx=a.tokens + 256, chunk=256,
                   cache_type_k=a.cache_type, cache_type_v=a.cache_type)
    rng = random.Random(a.seed)
    methods = a.methods.split(",")
    kept = [float(x) for x in a.kept.split(",")]
    rows = []
    with Progress(transient=True) as prog:
        task = prog.add_task("passkey", total=a.n)
        for i in range(a.n):
            text, key = make_sample(sess.model, a.tokens, rng)
            pre = protocol.prefill(sess, sess.model.tokenize(text, add_special=True))
            prefill_s, n_prompt = pre.seconds, pre.n_cells
            q = sess.model.tokenize(QUESTION, add_special=False)
            for m in methods:
                for frac in ([1.0] if m == "full" else kept):
                    target = n_prompt if m == "full" else max(1, int(round(frac * n_prompt)))
                    comp_s = protocol.compress_once(sess, pre, m, target=target)
                    sess.feed(q)
                    out = "".join(sess.generate(8))
                    got = re.findall(r"\d{5}", out)
                    rows.append({"sample": i, "method": m, "kept": frac, "prompt_tokens": n_prompt,
                                 "cells": sess.engine.n_cells - len(q) - 8, "correct": key in got[:1],
                                 "answer": out.strip()[:40], "key": key, "prefill_s": prefill_s,
                                 "compress_s": comp_s})
            prog.advance(task)
    summary = {}
    for r in rows:
        k = f"{r['method']}@{r['kept']}"
        summary.setdefault(k, []).append(r["correct"])
    acc = {k: sum(v) / len(v) for k, v in summary.items()}
    payload = {"bench": "passkey", "machine": machine(), "model": str(path.name), "args": vars(a),
               "accuracy": acc, "rows": rows}
    out = write_json(a.out, payload)
    plot(acc, methods, kept, RESULTS / f"{a.out}.png", path.name, a.tokens)
    print(f"wrote {out}")
    for k, v in acc.items():
        print(f"{k:24s} {v:.2f}")


def plot(acc: dict[str, float], methods: list[str], kept: list[float], path: Path, model: str, n: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        if m == "full":
            ax.axhline(acc.get("full@1.0", 0), color="k", ls="--", label="full")
            continue
        ax.plot(kept, [acc.get(f"{m}@{f}", 0) for f in kept], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("kept fraction of the prompt's cells")
    ax.set_ylabel("passkey accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"passkey, {model}, ~{n} tokens, query-agnostic")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
