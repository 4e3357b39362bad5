#!/usr/bin/env python3
"""Why Gemma 3 loses its needles under compression: the engine, or the selection?

On the first ``--n`` niah_single samples (1024 tokens, chat template, as
``edgekv bench quality`` builds them) at ``--ratio``:

1. the full cache; an identity compaction (every cell kept); llama.cpp's own
   eviction of the middle (``llama_memory_seq_rm``) against edgekv's
   compaction keeping the same tokens (streaming_llm): the engine is right if
   the last two answer alike;
2. per method, how many of the needle's tokens each global (layer, KV head)
   keeps, and the answer;
3. the same selections with the needle's tokens (3 more on each side) forced
   into every (layer, head): if these answer, the selection was the cause;
4. the spread of key norms (coefficient of variation per (layer, head)) of the
   compressed layers, for Gemma 3 and SmolLM2, over the first 1000 tokens of Emma.

    .venv/bin/edgekv bench run gemma3_needles --n 4
writes bench/results/gemma3_needles.json. Any model and method runs the same way
(``--model smollm2-135m --methods lagkv,kvzip,expected_attention --out NAME``):
KVzip's scores come from its reconstruction pass, Expected Attention's from the
query statistics the prefill records.
"""

from __future__ import annotations

import argparse

import numpy as np

from edgekv.bench import protocol, runner, scoring, tasks
from edgekv.bench.results import machine, write_json
from edgekv.bench.speed import long_text_tokens
from edgekv.config import BudgetRule
from edgekv.methods import get_method
from edgekv.models import resolve_model
from edgekv.session import Session

TASK = "niah_single"


def _answer(sess: Session, prompt: tasks.Prompt, sample: tasks.Sample) -> tuple[str, float]:
    sess.feed_text(prompt.query, add_special=False)
    out = runner.generate_answer(sess, sample.max_new_tokens, runner.stop_rule(TASK))
    return out.strip()[:24], scoring.score(TASK, out, sample.answers)


def _force(keep: np.ndarray, need: np.ndarray, n: int, window: int) -> np.ndarray:
    """Swap the needle's tokens into every (layer, head) for its earliest other kept tokens."""
    out = keep.copy()
    for li in range(keep.shape[0]):
        for h in range(keep.shape[1]):
            k = set(keep[li, h].tolist())
            missing = [x for x in need if x not in k]
            drop = [x for x in keep[li, h] if x not in need and 4 <= x < n - window][: len(missing)]
            out[li, h] = np.array(sorted((k - set(drop)) | set(missing)))
    return out


def retention(rows: list[dict], m: str) -> dict[str, object]:
    """Over the samples: answers right, right with the needle forced in, and the share of
    (layer, KV head)s that kept every token of the needle, overall and per layer."""
    whole = np.array([[k == r[m]["of"] for k in r[m]["needle_kept"]] for r in rows], float)  # [samples, L * H]
    by_layer = whole.reshape(len(rows), len(rows[0][m]["layers"]), -1).mean(axis=(0, 2))
    return {"answered": sum(r[m]["answer"][1] > 0 for r in rows),
            "forced": sum(r[m]["needle_forced"][1] > 0 for r in rows),
            "whole": float(whole.mean()), "whole_by_layer": [round(float(x), 3) for x in by_layer]}


def key_norm_spread(model_name: str) -> dict[str, float]:
    with Session(resolve_model(model_name), n_ctx=1100, n_threads=2) as s:
        s.feed(long_text_tokens(s.model, 1000))
        snap = s.engine.snapshot()
        cv = []
        for layer in range(snap.n_layer):
            nr = np.linalg.norm(snap.keys(layer), axis=2)[4:]  # [n, H], sinks aside
            cv += list(nr.std(axis=0) / nr.mean(axis=0))
    return {"layers": snap.n_layer, "median": float(np.median(cv)), "min": float(min(cv)), "max": float(max(cv))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--methods", default="knorm,lagkv,random")
    ap.add_argument("--out", default="gemma3_needles", help="result name under bench/results")
    a = ap.parse_args()
    methods = a.methods.split(",")
    built = [get_method(m) for m in methods]
    if any(m.tallies for m in built):  # step 1 evicts through llama.cpp, behind a tally's back
        raise SystemExit("tallying methods (h2o) are not supported by this diagnostic")
    sess = Session(resolve_model(a.model), method="full", n_ctx=2048, n_threads=2,
                   observe=max(m.queries_needed for m in built),
                   moments=any(m.query_statistics for m in built), scratch_cells=max(m.scratch_cells for m in built))
    frame = tasks.chat_frame(sess.model)
    count = lambda t: len(sess.model.tokenize(t, add_special=False))  # noqa: E731
    rows = []
    for i in range(a.n):
        sample = tasks.make_sample(TASK, 1024, 0, i, count)
        prompt = tasks.build_prompt(sample, frame=frame)
        pre = protocol.prefill(sess, sess.model.tokenize(prompt.context, add_special=True))
        n = pre.n_cells
        cut = prompt.context.index(sample.answers[0])
        a0 = len(sess.model.tokenize(prompt.context[:cut], add_special=True))
        a1 = len(sess.model.tokenize(prompt.context[: cut + len(sample.answers[0])], add_special=True))
        target = BudgetRule(ratio=a.ratio, capacity=sess.capacity).target(n)
        row: dict[str, object] = {"sample": i, "cells": n, "needle_tokens": [a0, a1],
                                  "depth": sample.meta["depths"][0]}
        protocol.compress_once(sess, pre, "full")
        row["full"] = _answer(sess, prompt, sample)
        sess.restore(pre.saved)
        snap = sess.engine.snapshot()
        sess.engine.compact(np.broadcast_to(np.arange(n), (snap.n_layer, snap.n_kv_head, n)).copy())
        row["identity"] = _answer(sess, prompt, sample)
        sess.restore(pre.saved)
        keep_n = target
        assert sess.ctx.seq_rm(0, 4, n - (keep_n - 4))
        sess.engine.tokens.n_cells = keep_n  # llama.cpp evicted the cells itself
        row["llama_seq_rm"] = _answer(sess, prompt, sample)
        protocol.compress_once(sess, pre, "streaming_llm", target=keep_n)
        row["streaming_llm"] = _answer(sess, prompt, sample)
        for m in methods:
            sess.restore(pre.saved)
            method = get_method(m)
            snap = method.snapshot(sess.engine)  # KVzip's: after its reconstruction pass
            keep = method.select(snap, target)
            kept = [int(np.isin(np.arange(a0, a1), snap.token_pos[li, h][keep[li, h]]).sum())
                    for li in range(keep.shape[0]) for h in range(keep.shape[1])]
            sess.engine.compact(keep)
            row[m] = {"needle_kept": kept, "of": a1 - a0, "layers": list(range(keep.shape[0])),
                      "answer": _answer(sess, prompt, sample)}
            sess.restore(pre.saved)
            sess.engine.compact(_force(keep, np.arange(a0 - 3, a1 + 3), n, method.window))
            row[m]["needle_forced"] = _answer(sess, prompt, sample)
        rows.append(row)
        print(row, flush=True)
    sess.close()
    summary = {m: retention(rows, m) for m in methods}
    for m, r in summary.items():
        print(f"{m}: answered {r['answered']}/{len(rows)}, with the needle forced in {r['forced']}/{len(rows)}; "
              f"(layer, head)s keeping the whole needle {100 * r['whole']:.0f} %, by layer "
              + " ".join(f"{100 * x:.0f}" for x in r["whole_by_layer"]), flush=True)
    spread = {name: key_norm_spread(name) for name in dict.fromkeys((a.model, "smollm2-135m"))}
    print("key-norm coefficient of variation:", spread)
    out = write_json(a.out, {"machine": machine(), "args": vars(a), "rows": rows, "summary": summary,
                             "key_norm_cv": spread})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
