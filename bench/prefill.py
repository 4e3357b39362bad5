#!/usr/bin/env python3
"""Prefill throughput, side by side in one run: edgekv's Session, llama-cpp-python's
``Llama.eval`` (the same libllama through its high-level API) and PyTorch fp32 on the
GGUF dequantised by transformers (the path kvpress users take; optional, needs
``.[compare]``).

For each prompt length, the implementations take turns (the order rotates every
round) on the same tokens of real prose; the medians over the rounds are reported.
edgekv is measured in each ``--edgekv`` configuration (prefill batch, flash attention),
so the fastest can become the default, and on the model converted to each of
``--weights`` (``edgekv models quantize``: opt-in, it changes the weights). After
each edgekv prefill, ``--decode`` tokens are decoded greedily, so a weight type's
prefill gain is read next to its decode speed.

    .venv/bin/edgekv bench run prefill --lengths 1024,4096,8192 --rounds 3
writes bench/results/prefill.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="1024,4096,8192")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--edgekv", default="512:off,512:on,2048:off",
                    help="edgekv configurations to measure, BATCH:FLASH_ATTN, comma-separated")
    ap.add_argument("--weights", default="", help="also edgekv (first configuration) on the model converted "
                    "to these weight types, e.g. q4_0,q8_0,f16")
    ap.add_argument("--decode", type=int, default=32, help="tokens decoded after each edgekv prefill")
    ap.add_argument("--impls", default="edgekv,llama_cpp,torch")
    ap.add_argument("--out", default="prefill")
    a = ap.parse_args()

    from edgekv.bench.results import machine, write_json
    from edgekv.bench.speed import long_text_tokens
    from edgekv.llama import Model
    from edgekv.models import resolve_model
    from edgekv.session import Session

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    path = resolve_model(a.model)
    model = Model(path)
    lengths = [int(x) for x in a.lengths.split(",")]
    configs = [(int(c), fa) for c, fa in (x.split(":") for x in a.edgekv.split(","))]
    impls = a.impls.split(",")
    tokens = long_text_tokens(model, max(lengths))

    runners: dict[str, object] = {}
    decode: dict[tuple[str, int], list[float]] = {}  # (runner, tokens) -> decode tok/s per round

    def edgekv_runner(name: str, m: Model, c: int, fa: str):
        def run(toks: list[int]) -> float:
            with Session(m, method="full", n_ctx=len(toks) + a.decode + 16, chunk=c, flash_attn=fa,
                         n_threads=a.threads) as s:
                t0 = time.perf_counter()
                s.feed(toks)
                secs = time.perf_counter() - t0
                t0 = time.perf_counter()
                for _ in range(a.decode):
                    s.feed([int(np.argmax(s.logits()))])
                decode.setdefault((name, len(toks)), []).append(a.decode / (time.perf_counter() - t0))
                return secs
        return run

    for c, fa in configs if "edgekv" in impls else []:
        name = f"edgekv batch {c}, flash attention {fa}"
        runners[name] = edgekv_runner(name, model, c, fa)
    for w in [w for w in a.weights.split(",") if w] if "edgekv" in impls else []:
        from edgekv.quantize import quantize

        qpath, _ = quantize(path, w)
        name = f"edgekv, weights converted to {w} (batch {configs[0][0]}, flash attention {configs[0][1]})"
        runners[name] = edgekv_runner(name, Model(qpath), *configs[0])
    if "llama_cpp" in impls:
        import llama_cpp

        llms: dict[int, llama_cpp.Llama] = {}

        def run_llama(toks: list[int]) -> float:
            if len(toks) not in llms:
                for old in llms.values():
                    old.close()
                llms.clear()
                llms[len(toks)] = llama_cpp.Llama(model_path=str(path), n_ctx=len(toks) + 16, n_batch=512,
                                                  n_threads=a.threads, n_threads_batch=a.threads, verbose=False)
            llm = llms[len(toks)]
            llm.reset()  # eval then removes every cell from position 0 on
            t0 = time.perf_counter()
            llm.eval(toks)
            return time.perf_counter() - t0
        runners["llama-cpp-python Llama.eval"] = run_llama
    if "torch" in impls:
        try:
            import torch
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging
        except ImportError:
            log("torch/transformers not installed (pip install -e .[compare]): PyTorch left out")
        else:
            hf_logging.disable_progress_bar()
            hf_logging.set_verbosity_error()
            torch.set_num_threads(a.threads)
            hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
            hf.eval()

            def run_torch(toks: list[int]) -> float:
                ids = torch.tensor([toks])
                with torch.no_grad():
                    t0 = time.perf_counter()
                    hf.model(input_ids=ids)
                    return time.perf_counter() - t0
            runners[f"PyTorch {torch.__version__} fp32"] = run_torch

    names = list(runners)
    rows = []
    for n in lengths:
        toks = tokens[:n]
        times: dict[str, list[float]] = {k: [] for k in names}
        for r in range(a.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                times[name].append(runners[name](toks))
                log(f"{n} tokens, round {r + 1}/{a.rounds}: {name} {n / times[name][-1]:.0f} tok/s")
        for name in names:
            med = statistics.median(times[name])
            dec = decode.get((name, n))
            rows.append({"impl": name, "tokens": n, "seconds": [round(t, 3) for t in times[name]],
                         "tok_s": round(n / med, 1),
                         "decode_tok_s": round(statistics.median(dec), 1) if dec else None})
            log(f"== {n} tokens: {name} {n / med:.1f} tok/s (median of {a.rounds})"
                + (f", then decode {statistics.median(dec):.1f} tok/s" if dec else ""))
    out = write_json(a.out, {"machine": machine(), "command": " ".join(["bench/prefill.py", *sys.argv[1:]]),
                             "model": a.model, "threads": a.threads, "rows": rows})
    log(str(out))


if __name__ == "__main__":
    main()
