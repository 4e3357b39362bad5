"""Helpers several test modules share (test modules never import each other)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

SCRIPT = Path(sys.executable).parent / "edgekv"
CMD = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "edgekv.cli"]


# KL (nats) under which two next-token distributions count as the same cache computed two
# equally correct ways (rounding in another order, a re-quantisation that lands a code one
# step over). Any such difference, even 1 q8_0 K code in 100,000 moved one step, moves
# SmolLM2's logits by 0.4 to 1.2 and its KL to 2e-3..1.2e-2 (40 draws on the AVX2 and the
# AVX-512 kernels); keys left unrotated give 0.21 to 0.25 (bench/kshift_noise.py,
# bench/RESULTS.md). So: 4x the largest noise measured, 4x below that bug. Argmax equality
# is no such test: where the top two logits lie closer than the noise (0.018 to 0.035 in
# test_rerotate), the CPU's kernels pick the winner.
KL_NOISE = 0.05


def next_token_kl(ref: np.ndarray, got: np.ndarray) -> float:
    """KL(ref || got) in nats between the next-token distributions of two logit vectors."""
    from edgekv.bench.scoring import kl_top1, log_softmax

    return kl_top1(log_softmax(ref)[None], log_softmax(got)[None])[0]


def prefill(eng, toks: list[int], batch: int = 128) -> None:
    """Empty the engine's sequence and decode ``toks`` into it, ``batch`` at a time."""
    eng.reset()
    for i in range(0, len(toks), batch):
        eng.decode(toks[i : i + batch], i)


def run_cli(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real ``edgekv`` console script in a subprocess."""
    env = dict(os.environ)
    env.pop("EDGEKV_VERBOSE", None)  # llama.cpp's log would land on stderr
    env.update(COLUMNS="200", NO_COLOR="1", TERM="dumb", PYTHONUNBUFFERED="1")
    return subprocess.run(
        [*CMD, *map(str, args)],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def random_keep(rng: np.random.Generator, L: int, H: int, n: int, b: int) -> np.ndarray:
    """[L, H, b] ascending cells to keep: a different random set per (layer, head), always
    with the newest 8 (a per-head compaction as the methods make them)."""
    keep = np.empty((L, H, b), dtype=np.int64)
    for li in range(L):
        for h in range(H):
            keep[li, h] = np.sort(np.concatenate([rng.choice(n - 8, b - 8, replace=False), np.arange(n - 8, n)]))
    return keep
