#!/usr/bin/env python3
"""edgekv next to kvpress (NVIDIA's PyTorch reference) on the same GGUF model and the same prompts.

Two parts, for every method both have (knorm, streaming_llm, snapkv, chunkkv, lagkv, random):

1. **Accuracy side by side.** The samples of edgekv's quality sweep (niah_single,
   niah_multikey, vt at 1024 tokens, chat template, query-agnostic), tokenized
   once by llama.cpp, so both get identical token ids:
   - kvpress runs its own pipeline internals (compress during the context's
     prefill, then greedy answers at the original positions) on the model
     transformers dequantises from the GGUF (fp32);
   - edgekv runs its sweep's protocol (prefill, compress once, ask) on the GGUF
     through llama.cpp, with its defaults and with kvpress's settings where they
     differ (sinks, window, per-layer chunks).
   Both are scored by edgekv's scorer.
2. **Kept-set overlap on identical K/V.** One sample's context goes through
   transformers with each press. At each layer, the press is handed its keys,
   values and hidden states; kvpress's kept cells are read from what it
   returns (rows matched exactly). edgekv's method selects from the same keys,
   values and window queries (computed as kvpress's SnapKV computes them). The
   overlap is the share of kvpress's kept cells that edgekv keeps, per (layer,
   KV head).

Needs the optional dependencies: `.venv/bin/pip install torch==2.13.0` (the CPU
build), then `.venv/bin/pip install -e .[compare]`.

    .venv/bin/edgekv bench run kvpress_compare --n 10 --ratios 0.5,0.75
writes bench/results/kvpress_compare/{results.jsonl, overlap.json, report.md}; it resumes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

TASKS = ("niah_single", "niah_multikey", "vt")
LENGTH = 1024

# name -> (edgekv variants: label -> (method, params), kvpress press factory (ratio) -> press)
# "edgekv" is edgekv's defaults; "edgekv as kvpress" takes kvpress's settings where edgekv's differ.
PAIRS: dict[str, dict] = {
    "knorm": {"edgekv": ("knorm", {}), "edgekv as kvpress": ("knorm", {"sinks": 0, "window": 0})},
    "streaming_llm": {"edgekv": ("streaming_llm", {})},
    "snapkv": {"edgekv": ("snapkv", {})},
    # ChunkKV's defaults are kvpress's configuration; the per-head rule was the default before
    "chunkkv": {"edgekv per head": ("chunkkv", {"per_layer": False, "chunk": 10, "window": 32}),
                "edgekv as kvpress": ("chunkkv", {})},
    "lagkv": {"edgekv": ("lagkv", {}), "edgekv as kvpress": ("lagkv", {"sinks": 4})},
    "random": {"edgekv": ("random", {})},
    "full": {"edgekv": ("full", {})},  # no compression: what fp32 PyTorch against llama.cpp alone changes
}


def make_press(name: str, ratio: float):
    from kvpress import (
        ChunkKVPress,
        KnormPress,
        LagKVPress,
        RandomPress,
        SnapKVPress,
        StreamingLLMPress,
    )

    return {
        "full": lambda: None,
        "knorm": lambda: KnormPress(compression_ratio=ratio),
        "streaming_llm": lambda: StreamingLLMPress(compression_ratio=ratio, n_sink=4),
        "snapkv": lambda: SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5),
        "chunkkv": lambda: ChunkKVPress(press=SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5),
                                        chunk_length=20),
        "lagkv": lambda: LagKVPress(compression_ratio=ratio, n_sink=4, lag_size=128),
        "random": lambda: RandomPress(compression_ratio=ratio, seed=0),
    }[name]()


def load_hf(gguf: Path, threads: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    return model, tok


def cut_like_edgekv(task: str, text: str) -> str:
    """kvpress's answer up to where edgekv's generation would have stopped (its stop rule for
    the task, applied to every prefix), so both are scored on the same span."""
    from edgekv.bench.runner import stop_rule

    stop = stop_rule(task)
    for i in range(1, len(text) + 1):
        if stop(text[:i]):
            return text[:i]
    return text


def kvpress_answer(pipe, press, context_ids: list[int], query_ids: list[int], max_new: int) -> tuple[str, int]:
    """kvpress's own prefill-with-press and greedy answer; (answer, cells kept in layer 0)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        out = pipe._forward({"context_ids": torch.tensor([context_ids]), "questions_ids": [torch.tensor([query_ids])]},
                            max_new_tokens=max_new, press=press, cache=cache)
    return out[0], int(cache.get_seq_length(0))


def accuracy(args, model_path: Path, out: Path, log) -> None:
    import kvpress  # noqa: F401  (registers the kv-press-text-generation pipeline)
    import torch
    from transformers import pipeline

    from edgekv.bench import protocol, scoring, tasks
    from edgekv.bench.runner import Grid, prepare, run_oneshot
    from edgekv.llama import Model
    from edgekv.methods import get_method
    from edgekv.session import Session

    path = out / "results.jsonl"
    done = set()
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            done.add((r["task"], r["sample"], r["method"], r["ratio"], r["impl"]))
    hf, tok = load_hf(model_path, args.threads)
    pipe = pipeline("kv-press-text-generation", model=hf, tokenizer=tok, device="cpu")
    ekv = Model(model_path)
    grid = Grid(n=args.n, lengths=[LENGTH], tasks=list(TASKS))
    frame = tasks.chat_frame(ekv)
    observe = max(get_method(m, **p).queries_needed for v in PAIRS.values() for m, p in v.values())
    total = args.n * len(TASKS) * sum((len(v) + 1) * (1 if k == "full" else len(args.ratios)) for k, v in PAIRS.items())
    n_done = 0
    with Session(ekv, method="full", n_ctx=LENGTH + 256, chunk=512, n_threads=args.threads,
                 observe=observe) as sess, open(path, "a") as f:
        for i in range(args.n):
            for task in TASKS:
                prep = prepare(ekv, task, LENGTH, grid, i, frame, None)
                ctx = ekv.tokenize(prep.prompt.context, add_special=True)
                query = ekv.tokenize(prep.prompt.query, add_special=False)
                pre = None
                for name, variants in PAIRS.items():
                    for ratio in ([0.0] if name == "full" else args.ratios):
                        base = {"task": task, "sample": i, "method": name, "ratio": ratio, "length": LENGTH}
                        key = (task, i, name, ratio)
                        for impl, (m, params) in variants.items():
                            n_done += 1
                            if (*key, impl) in done:
                                continue
                            if pre is None:
                                pre = protocol.prefill(sess, ctx)
                            t0 = time.perf_counter()
                            row = run_oneshot(sess, prep, get_method(m, **params), ratio, pre)
                            row.update(base, impl=impl, params=params, seconds=round(time.perf_counter() - t0, 2),
                                       prompt_tokens=len(ctx))
                            f.write(json.dumps(row) + "\n")
                            f.flush()
                        n_done += 1
                        if (*key, "kvpress") in done:
                            continue
                        t0 = time.perf_counter()
                        answer, kept = kvpress_answer(pipe, make_press(name, ratio), ctx, query,
                                                      prep.sample.max_new_tokens)
                        answer = cut_like_edgekv(task, answer)
                        row = {**base, "impl": "kvpress", "score": scoring.score(task, answer, prep.sample.answers),
                               "output": answer.strip()[:200], "answers": list(prep.sample.answers), "cells": kept,
                               "seconds": round(time.perf_counter() - t0, 2), "prompt_tokens": len(ctx),
                               "versions": {"kvpress": _version("kvpress"), "transformers": _version("transformers"),
                                            "torch": torch.__version__}}
                        f.write(json.dumps(row) + "\n")
                        f.flush()
                        log(f"[{n_done}/{total}] {task} #{i} {name}@{ratio}: kvpress {row['score']:.2f}")
    ekv.close()


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


def overlap(args, model_path: Path, out: Path, log) -> dict:
    """Per method and ratio: the share of kvpress's kept cells edgekv keeps, on identical K/V."""
    import torch
    from kvpress.utils import get_prerope_query_states  # SnapKV's own way to the window queries
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import rotate_half

    from edgekv.bench import tasks
    from edgekv.bench.runner import Grid, prepare
    from edgekv.config import BudgetRule
    from edgekv.kvcache.queries import QueryWindow
    from edgekv.kvcache.snapshot import KVSnapshot
    from edgekv.llama import Model
    from edgekv.methods import get_method

    hf, _ = load_hf(model_path, args.threads)
    ekv = Model(model_path)
    prep = prepare(ekv, "niah_single", LENGTH, Grid(lengths=[LENGTH]), 0, tasks.chat_frame(ekv), None)
    ids = torch.tensor([ekv.tokenize(prep.prompt.context, add_special=True)])
    window = 64
    result: dict[str, dict] = {}
    for name, variants in PAIRS.items():
        if name in ("random", "full"):
            continue  # two random draws, or nothing removed: nothing to compare
        for ratio in args.ratios:
            press = make_press(name, ratio)
            seen: dict[int, dict] = {}
            orig = press.compress

            def record(module, hidden_states, keys, values, attentions, kwargs, _orig=orig, _seen=seen):
                k2, v2 = _orig(module, hidden_states, keys, values, attentions, kwargs)
                kept = []
                for h in range(keys.shape[1]):
                    rows = {keys[0, h, t].numpy().tobytes(): t for t in range(keys.shape[2])}
                    assert len(rows) == keys.shape[2], "two identical key rows: kept cells would be ambiguous"
                    kept.append(sorted(rows[k2[0, h, j].numpy().tobytes()] for j in range(k2.shape[2])))
                q = get_prerope_query_states(module, hidden_states[:, -window:])
                cos, sin = kwargs["position_embeddings"]
                cos, sin = cos[:, -window:].unsqueeze(1), sin[:, -window:].unsqueeze(1)
                q = q * cos + rotate_half(q) * sin
                _seen[module.layer_idx] = {"k": keys[0].permute(1, 0, 2).numpy().copy(),
                                           "v": values[0].permute(1, 0, 2).numpy().copy(),
                                           "q": q[0].numpy().copy(), "kept": np.array(kept)}
                return k2, v2

            press.compress = record
            with torch.no_grad(), press(hf):
                hf.model(input_ids=ids, past_key_values=DynamicCache())
            layers = sorted(seen)
            n = seen[layers[0]]["k"].shape[0]
            win = QueryWindow(window, tuple(layers), np.stack([seen[i]["q"] for i in layers]),
                              np.arange(n - window, n, dtype=np.int32))
            snap = KVSnapshot.from_arrays([seen[i]["k"] for i in layers], [seen[i]["v"] for i in layers],
                                          queries=win)
            want = np.stack([seen[i]["kept"] for i in layers])  # [L, H, B]
            for impl, (m, params) in variants.items():
                method = get_method(m, **params)
                method.bind(BudgetRule(ratio=ratio))
                got = method.select(snap, want.shape[2])
                share = np.array([[len(set(got[li, h]) & set(want[li, h])) / want.shape[2]
                                   for h in range(want.shape[1])] for li in range(want.shape[0])])
                result.setdefault(name, {}).setdefault(str(ratio), {})[impl] = {
                    "mean": round(float(share.mean()), 4), "min_layer": round(float(share.mean(1).min()), 4),
                    "exact_heads": round(float((share == 1.0).mean()), 4),
                    "per_layer": [round(float(x), 4) for x in share.mean(1)]}
                log(f"overlap {name}@{ratio} {impl}: {share.mean():.3f} (min layer {share.mean(1).min():.3f})")
    payload = {"sample": "niah_single #0", "length": int(ids.shape[1]), "window": window, "overlap": result,
               "versions": {"kvpress": _version("kvpress"), "transformers": _version("transformers"),
                            "torch": torch.__version__}}
    (out / "overlap.json").write_text(json.dumps(payload, indent=1))
    return payload


def report(out: Path) -> str:
    rows = []
    path = out / "results.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line (interrupted)
            continue
    # only samples every implementation of a (method, ratio) has, so both means cover the same prompts
    impls: dict[tuple, set[str]] = {}
    for r in rows:
        impls.setdefault((r["method"], r["ratio"]), set()).add(r["impl"])
    have: dict[tuple, set[str]] = {}
    for r in rows:
        have.setdefault((r["method"], r["ratio"], r["task"], r["sample"]), set()).add(r["impl"])
    # score per (method, ratio, impl) -> {(task, sample): score}, complete samples only
    scores: dict[tuple, dict[tuple, float]] = {}
    for r in rows:
        if have[(r["method"], r["ratio"], r["task"], r["sample"])] == impls[(r["method"], r["ratio"])]:
            scores.setdefault((r["method"], r["ratio"], r["impl"]), {})[(r["task"], r["sample"])] = r["score"]
    variants = ["edgekv", "edgekv as kvpress"]
    lines = ["Accuracy % over the same prompts; agree = share of prompts where edgekv's score equals kvpress's.",
             "", "| method | ratio | n | kvpress | edgekv (agree) | edgekv as kvpress (agree) |",
             "|---|---:|---:|---:|---:|---:|"]
    for m, ratio in sorted({(m, ratio) for m, ratio, _ in scores}):
        ref = scores.get((m, ratio, "kvpress"), {})
        cols = []
        for impl in variants:
            got = scores.get((m, ratio, impl))
            if not got:
                cols.append("–")
                continue
            acc = 100 * sum(got.values()) / len(got)
            if ref:
                agree = 100 * sum(got[k] == ref[k] for k in got) / len(got)
                cols.append(f"{acc:.1f} ({agree:.0f} %)")
            else:
                cols.append(f"{acc:.1f}")
        n = len(ref) or max(len(scores.get((m, ratio, i), {})) for i in variants)
        kv = f"{100 * sum(ref.values()) / len(ref):.1f}" if ref else "–"
        lines.append(f"| {m} | {ratio:g} | {n} | {kv} | {cols[0]} | {cols[1]} |")
    ov = out / "overlap.json"
    if ov.is_file():
        data = json.loads(ov.read_text())["overlap"]
        lines += ["", "| method | ratio | edgekv variant | kept overlap | min layer | exact heads |", "|---|---:|---|---:|---:|---:|"]
        for m, by in data.items():
            for ratio, impls in by.items():
                for impl, s in impls.items():
                    lines.append(f"| {m} | {ratio} | {impl} | {100 * s['mean']:.1f} % | {100 * s['min_layer']:.1f} % | "
                                 f"{100 * s['exact_heads']:.0f} % |")
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--ratios", default="0.5,0.75")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parts", default="overlap,accuracy")
    ap.add_argument("--out", default="bench/results/kvpress_compare")
    args = ap.parse_args()
    args.ratios = [float(x) for x in args.ratios.split(",")]
    from edgekv.models import resolve_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(args.model)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    parts = args.parts.split(",")
    if "overlap" in parts:
        overlap(args, model_path, out, log)
    if "accuracy" in parts:
        accuracy(args, model_path, out, log)
    print(report(out))


if __name__ == "__main__":
    main()
