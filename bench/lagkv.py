#!/usr/bin/env python3
"""Passkey accuracy of LagKV (L = 128, 512) against its ratio, next to full,
streaming_llm and knorm at the same memory, on one or more models.

Protocol (bench/passkey.py's, query-agnostic): each haystack is prefilled once
with the full cache (the paper's default prefill) and its state restored for
every configuration. LagKV then runs its paper step at r = 1 - R (--ratio R =
fraction removed inside each compressed partition); the cache it leaves is
Eq. 10's size, larger than (1 - R) of the prompt because the sinks and the
L..2L-1 window stay whole. streaming_llm and knorm are compressed to exactly
the cells LagKV kept for the same sample, so every point compares equal
memory. Then the question arrives and 8 tokens are generated greedily (LagKV
keeps compressing on its own schedule meanwhile).

    .venv/bin/edgekv bench run lagkv --n 10 --tokens 1500
writes bench/results/lagkv.json and lagkv.png.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path

from bench.passkey import QUESTION, make_sample  # noqa: E402
from edgekv.bench import protocol
from edgekv.bench.results import RESULTS, machine, write_json
from edgekv.config import BudgetRule

BASELINES = ("streaming_llm", "knorm")


def run_model(model_arg: str, a: argparse.Namespace, rows: list[dict], save) -> None:
    from edgekv.methods import get_method
    from edgekv.methods.lagkv import LagKV, retained_cells
    from edgekv.models import resolve_model
    from edgekv.session import Session

    path = resolve_model(model_arg)
    sess = Session(path, method="full", n_ctx=a.tokens + 256, chunk=256, n_threads=a.threads)
    rng = random.Random(a.seed)
    lags = [int(x) for x in a.lags.split(",")]
    ratios = [float(x) for x in a.ratios.split(",")]
    q = sess.model.tokenize(QUESTION, add_special=False)
    t_model = time.perf_counter()
    for i in range(a.n):
        text, key = make_sample(sess.model, a.tokens, rng)
        pre = protocol.prefill(sess, sess.model.tokenize(text, add_special=True))
        prefill_s, n_prompt = pre.seconds, pre.n_cells

        trials = [(get_method("full"), n_prompt, {"L": None, "ratio": 0.0})]
        for R in ratios:
            for L in lags:
                m = LagKV(L=L)
                m.bind(BudgetRule(ratio=R))  # the paper's ratio mode: r = 1 - R
                cells = retained_cells(n_prompt, m.sinks, L, m.keep_per_partition)
                info = {"L": L, "ratio": R}
                trials += [(m, cells, info)] + [(get_method(b), cells, info) for b in BASELINES]
        for method, cells, info in trials:
            # LagKV's own schedule stays on during the question, as in a session
            comp_s = protocol.compress_once(sess, pre, method, ratio=info["ratio"], target=cells, scheduled=True)
            kept = sess.engine.n_cells
            sess.feed(q)
            out = ""
            for piece in sess.generate(8):  # stops early once a 5-digit answer is out
                out += piece
                if re.search(r"\d{5}", out):
                    break
            got = re.findall(r"\d{5}", out)
            rows.append({"model": path.name, "sample": i, "method": method.name, **info,
                         "prompt_tokens": n_prompt, "cells": kept, "kept": kept / n_prompt,
                         "correct": key in got[:1], "answer": out.strip()[:40], "key": key,
                         "prefill_s": prefill_s, "compress_s": comp_s})
        done = sum(r["correct"] for r in rows
                   if r["model"] == path.name and r["sample"] == i and r["method"] == "lagkv")
        print(f"  {path.name} sample {i + 1}/{a.n}: key {key}, prefill {prefill_s:.1f}s, "
              f"lagkv correct {done}/{len(ratios) * len(lags)}, {time.perf_counter() - t_model:.0f}s so far",
              flush=True)
        save()  # partial results survive an interrupted run
    sess.close()


def summarise(rows: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """model -> 'method@L=..,R=..' -> {accuracy, kept, cells, n}."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        k = "full" if r["method"] == "full" else f"{r['method']}@L={r['L']},R={r['ratio']}"
        groups.setdefault((r["model"], k), []).append(r)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (model, k), rs in groups.items():
        out.setdefault(model, {})[k] = {
            "accuracy": sum(r["correct"] for r in rs) / len(rs),
            "kept": sum(r["kept"] for r in rs) / len(rs),
            "cells": sum(r["cells"] for r in rs) / len(rs),
            "compress_s": sum(r["compress_s"] for r in rs) / len(rs),
            "n": len(rs),
        }
    return out


def plot(summary: dict, lags: list[int], ratios: list[float], path: Path, tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(summary)
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    styles = {"lagkv": "-", "streaming_llm": ":", "knorm": "--"}
    colors = {128: "tab:blue", 512: "tab:orange"}
    for ax, model in zip(axes[0], models, strict=True):
        s = summary[model]
        ax.axhline(s["full"]["accuracy"], color="k", ls="-.", label="full")
        for L in lags:
            for m in ("lagkv", *BASELINES):
                pts = sorted((s[f"{m}@L={L},R={R}"]["kept"], s[f"{m}@L={L},R={R}"]["accuracy"]) for R in ratios)
                label = f"lagkv L={L}" if m == "lagkv" else f"{m} (cells of L={L})"
                ax.plot(*zip(*pts, strict=True), ls=styles[m], marker="o" if m == "lagkv" else ".",
                        color=colors.get(L), alpha=1.0 if m == "lagkv" else 0.6, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("kept fraction of the prompt's cells (LagKV: Eq. 10 at R = " +
                      ", ".join(f"{r:g}" for r in ratios) + ")")
        ax.set_ylabel("passkey accuracy")
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"{model}, ~{tokens} tokens", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b", help="comma-separated names or paths")
    ap.add_argument("--lags", default="128,512", help="LagKV partition lengths L")
    ap.add_argument("--ratios", default="0.5,0.75,0.875", help="--ratio values R (fraction removed; r = 1 - R)")
    ap.add_argument("--n", type=int, default=10, help="samples per model")
    ap.add_argument("--tokens", type=int, default=1500, help="haystack length in tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="lagkv")
    a = ap.parse_args()

    t0 = time.perf_counter()
    rows: list[dict] = []

    def save(done: bool = False) -> Path:
        return write_json(a.out, {"bench": "lagkv_passkey", "machine": machine(), "args": vars(a),
                                  "complete": done, "seconds": time.perf_counter() - t0,
                                  "summary": summarise(rows), "rows": rows})

    for model in a.models.split(","):
        run_model(model, a, rows, save)
    summary = summarise(rows)
    lags = [int(x) for x in a.lags.split(",")]
    ratios = [float(x) for x in a.ratios.split(",")]
    out = save(done=True)
    plot(summary, lags, ratios, RESULTS / f"{a.out}.png", a.tokens)
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    for model, s in summary.items():
        print(model)
        print(f"  {'config':34s} {'acc':>5s} {'kept':>6s} {'cells':>7s}")
        for k, v in s.items():
            print(f"  {k:34s} {v['accuracy']:5.2f} {v['kept']:6.3f} {v['cells']:7.1f}")


if __name__ == "__main__":
    main()
