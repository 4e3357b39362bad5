#!/usr/bin/env python3
"""Flash attention on against off on the CPU: prefill and decode speed, interleaved.

This decides what edgekv's ``--flash-attn auto`` means on the CPU
(``edgekv.llama.resolve_flash_attn``). A shared machine drifts by tens of
percent over minutes, so the two settings are measured alternately at every
context length and each number is the median over ``--repeat`` rounds.

    .venv/bin/edgekv bench run flash_attention --lengths 1k,2k,4k --repeat 2
writes bench/results/flash_attn.json and flash_attn.png.
"""

from __future__ import annotations

import argparse
import statistics
import time

from edgekv.bench.results import RESULTS, machine, write_json


def _length(s: str) -> int:
    s = s.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


def measure(model, toks: list[int], fa: str, decode_tokens: int, threads: int | None) -> dict[str, float]:
    from edgekv.session import Session

    with Session(model, method="full", n_ctx=len(toks) + decode_tokens + 16, chunk=512, flash_attn=fa,
                 n_threads=threads) as s:
        t0 = time.perf_counter()
        s.feed(toks)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        n = 0
        for tok in s.generate_tokens(decode_tokens):
            del tok
            n += 1
        decode = time.perf_counter() - t0
    return {"prefill_tok_s": len(toks) / prefill, "decode_ms_per_tok": 1000 * decode / max(n, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1k,2k,4k", help="context lengths (1k = 1024)")
    ap.add_argument("--repeat", type=int, default=2, help="rounds of (off, on) per length; medians are reported")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    from edgekv.bench.speed import long_text_tokens
    from edgekv.llama import Model
    from edgekv.models import resolve_model

    model = Model(resolve_model(None))
    rows = []
    try:
        for length in (_length(x) for x in args.lengths.split(",")):
            toks = long_text_tokens(model, length)
            runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
            for r in range(args.repeat):
                for fa in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    runs[fa].append(measure(model, toks, fa, args.decode_tokens, args.threads))
            row = {"length": length}
            for fa, ms in runs.items():
                for k in ("prefill_tok_s", "decode_ms_per_tok"):
                    row[f"{k}_{fa}"] = round(statistics.median(m[k] for m in ms), 2)
            rows.append(row)
            print(f"{length:6d} tokens: prefill tok/s off {row['prefill_tok_s_off']:.0f} / on "
                  f"{row['prefill_tok_s_on']:.0f}; decode ms/token off {row['decode_ms_per_tok_off']:.1f} / on "
                  f"{row['decode_ms_per_tok_on']:.1f}", flush=True)
    finally:
        model.close()
    path = write_json("flash_attn", {"machine": machine(), "model": "smollm2-135m", "cache_type": "f16",
                                     "repeat": args.repeat, "decode_tokens": args.decode_tokens, "rows": rows})
    print(f"wrote {path}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.4))
    xs = [r["length"] for r in rows]
    for ax, key, label in ((axes[0], "prefill_tok_s", "prefill tok/s"), (axes[1], "decode_ms_per_tok", "decode ms/token")):
        for fa, style in (("off", "-o"), ("on", "--s")):
            ax.plot(xs, [r[f"{key}_{fa}"] for r in rows], style, ms=4, label=f"flash attention {fa}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M, f16 KV cache, CPU (2 threads)", fontsize=9)
    fig.tight_layout()
    out = RESULTS / "flash_attn.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
