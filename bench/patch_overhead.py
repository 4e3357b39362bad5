#!/usr/bin/env python3
"""What edgekv's patch set costs when nothing uses it: patched against stock llama.cpp.

The same driver (llama-cpp-python's low-level API only, no edgekv code, no
compression) runs in alternating subprocesses against two builds of
llama-cpp-python 0.3.36 with the same flags (AMX compiled out; a stock
build with AMX crashes on AMX CPUs):

- **patched**: the wheel ``scripts/setup.sh`` installs (``ggml_patches/`` applied);
- **stock**: ``native/build_llama.py --stock --target DIR``, built on first
  use (about 9 minutes on 2 cores without ccache; the ggml files come from
  ccache when the patched build filled it).

For each context length and flash-attention setting it times the prefill of
the prompt (batches of 512; repeated inside the process up to 4k tokens in
all, the median kept) and then 128 single-token decodes (three times, the
median kept), a round at a time, stock and patched in alternating order
(ABBA), and reports medians over the rounds and the patched/stock ratio of
the medians. A shared machine drifts by tens of percent over minutes (a first
run with one prefill and 64 decodes per process put 1k-token ratios at 0.85
and 1.07), which is why the two sides alternate and each process repeats.

    .venv/bin/edgekv bench run patch_overhead --lengths 1k,4k,8k --rounds 5
writes bench/results/patch_overhead.json and patch_overhead.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DECODE_TOKENS = 128
DECODE_REPS = 3


# -- the driver: runs in a subprocess against one build ---------------------------
def drive(model: str, tokens_file: str, length: int, fa: str, threads: int) -> dict[str, float]:
    """Prefill ``length`` tokens, then decode DECODE_TOKENS one at a time; llama_cpp only."""
    import ctypes

    import llama_cpp.llama_cpp as L

    quiet = L.llama_log_callback(lambda *a: None)  # referenced until exit: C calls it
    L.llama_log_set(quiet, ctypes.c_void_p(0))
    L.llama_backend_init()
    toks = json.loads(Path(tokens_file).read_text())
    assert len(toks) >= length + DECODE_TOKENS
    mp = L.llama_model_default_params()
    m = L.llama_model_load_from_file(model.encode(), mp)
    if not m:
        raise SystemExit(f"cannot load {model}")
    cp = L.llama_context_default_params()
    cp.n_ctx = length + DECODE_TOKENS + 16
    cp.n_batch = cp.n_ubatch = 512
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = {"off": 0, "on": 1}[fa]
    cp.no_perf = True
    ctx = L.llama_init_from_model(m, cp)
    if not ctx:
        raise SystemExit("cannot create a context")
    batch = L.llama_batch_init(512, 0, 1)

    def decode(part: list[int], start: int) -> None:
        batch.n_tokens = len(part)
        for i, t in enumerate(part):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, start + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(part) - 1
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")

    mem = L.llama_get_memory(ctx)
    prefills = []
    for _ in range(max(1, 4096 // length)):
        L.llama_memory_clear(mem, True)
        t0 = time.perf_counter()
        for i in range(0, length, 512):
            decode(toks[i : min(i + 512, length)], i)
        prefills.append(time.perf_counter() - t0)
    decodes = []
    for _ in range(DECODE_REPS):
        L.llama_memory_seq_rm(mem, 0, length, -1)
        t0 = time.perf_counter()
        for j in range(DECODE_TOKENS):
            decode([toks[length + j]], length + j)
        decodes.append(time.perf_counter() - t0)
    prefill, dec = statistics.median(prefills), statistics.median(decodes)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(m)
    return {"prefill_tok_s": length / prefill, "decode_tok_s": DECODE_TOKENS / dec,
            "system_info": L.llama_print_system_info().decode().strip(),
            "patched": hasattr(L._lib, "llama_edgekv_api_version")}


# -- the harness ----------------------------------------------------------------
def _length(s: str) -> int:
    s = s.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


def stock_dir() -> Path:
    """A stock llama-cpp-python with edgekv's flags, installed into the build cache on first use."""
    key = subprocess.run([sys.executable, str(ROOT / "native" / "build_llama.py"), "--stock", "--print-key"],
                         capture_output=True, text=True, check=True).stdout.strip()
    from edgekv.models import edgekv_home

    target = edgekv_home() / "stock" / key
    if not (target / "llama_cpp").is_dir():
        print(f"[patch_overhead] building stock llama-cpp-python into {target}", flush=True)
        subprocess.run([sys.executable, str(ROOT / "native" / "build_llama.py"), "--stock", "--target",
                        str(target)], check=True)
    return target


def run_one(build: str, stock: Path, model: str, tokens_file: str, length: int, fa: str,
            threads: int) -> dict[str, float]:
    env = dict(os.environ)
    if build == "stock":
        env["PYTHONPATH"] = str(stock) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, __file__, "--driver", model, tokens_file, str(length), fa, str(threads)],
                         env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"[patch_overhead] {build} driver failed:\n{out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if res["patched"] != (build == "patched"):
        raise SystemExit(f"[patch_overhead] the {build} run loaded the wrong libllama")
    return res


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--driver":
        model, tokens_file, length, fa, threads = sys.argv[2:7]
        print(json.dumps(drive(model, tokens_file, int(length), fa, int(threads))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1k,4k,8k", help="prompt lengths (1k = 1024 tokens)")
    ap.add_argument("--flash-attn", default="off,on")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per (length, flash attention); medians reported")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", type=Path, default=RESULTS / "patch_overhead.json")
    args = ap.parse_args()

    from edgekv.bench.runner import environment
    from edgekv.bench.speed import long_text_tokens
    from edgekv.llama import Model
    from edgekv.models import resolve_model

    lengths = [_length(x) for x in args.lengths.split(",")]
    fas = [x.strip() for x in args.flash_attn.split(",")]
    stock = stock_dir()
    model_path = str(resolve_model(None))
    model = Model(model_path)
    toks = long_text_tokens(model, max(lengths) + DECODE_TOKENS)
    model.close()
    rows = []
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(toks, f)
        tokens_file = f.name
    total = len(lengths) * len(fas) * args.rounds * 2
    done = 0
    t_start = time.perf_counter()
    try:
        for length in lengths:
            for fa in fas:
                runs: dict[str, list[dict]] = {"stock": [], "patched": []}
                for r in range(args.rounds):
                    for build in ("stock", "patched") if r % 2 == 0 else ("patched", "stock"):
                        runs[build].append(run_one(build, stock, model_path, tokens_file, length, fa, args.threads))
                        done += 1
                        el = time.perf_counter() - t_start
                        print(f"[{done}/{total}] {length} tokens, fa {fa}, round {r + 1}, {build}: prefill "
                              f"{runs[build][-1]['prefill_tok_s']:.1f} tok/s, decode "
                              f"{runs[build][-1]['decode_tok_s']:.1f} tok/s ({el / 60:.1f} min)", flush=True)
                row: dict[str, object] = {"length": length, "flash_attn": fa, "rounds": args.rounds}
                for key in ("prefill_tok_s", "decode_tok_s"):
                    for build, ms in runs.items():
                        row[f"{key}_{build}"] = round(statistics.median(m[key] for m in ms), 2)
                        row[f"{key}_{build}_all"] = [round(m[key], 2) for m in ms]
                    row[f"{key}_ratio"] = round(row[f"{key}_patched"] / row[f"{key}_stock"], 4)
                rows.append(row)
                print(f"== {length} tokens, fa {fa}: patched/stock prefill {row['prefill_tok_s_ratio']:.3f}, "
                      f"decode {row['decode_tok_s_ratio']:.3f}", flush=True)
    finally:
        os.unlink(tokens_file)
    payload = {"machine": environment(), "model": Path(model_path).name, "cache_type": "f16",
               "decode_tokens": DECODE_TOKENS, "system_info": runs["patched"][0]["system_info"],
               "command": "python bench/patch_overhead.py " + " ".join(sys.argv[1:]), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")
    plot(rows, args.out.with_suffix(".png"))


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.4))
    for ax, key, label in ((axes[0], "prefill_tok_s", "prefill"), (axes[1], "decode_tok_s", "decode")):
        for fa, style in (("off", "-o"), ("on", "--s")):
            sel = [r for r in rows if r["flash_attn"] == fa]
            if sel:
                ax.plot([r["length"] for r in sel], [r[f"{key}_ratio"] for r in sel], style, ms=4,
                        label=f"flash attention {fa}")
        ax.axhspan(0.97, 1.03, color="0.9", label="within 3 %")
        ax.axhline(1.0, color="0.5", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(f"{label} tok/s, patched / stock (median)")
        ax.legend(fontsize=7)
    fig.suptitle("edgekv patch set, unused: SmolLM2-135M, f16 KV cache, CPU", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
