"""Scoring of task outputs (RULER's string match, made boundary-aware) and perplexity."""

from __future__ import annotations

import math
import re

import numpy as np


def _found(ref: str, pred: str) -> bool:
    """``ref`` occurs in ``pred`` as a whole token: case-insensitive, and not inside a
    longer number or word ("1234567" does not match "12345678", "art" not "party")."""
    pat = r"(?<![0-9A-Za-z])" + re.escape(ref.lower()) + r"(?![0-9A-Za-z])"
    return re.search(pat, pred.lower()) is not None


def string_match_all(pred: str, refs: tuple[str, ...] | list[str]) -> float:
    """Fraction of the references present in the prediction (RULER's string_match_all)."""
    if not refs:
        return 0.0
    return sum(_found(r, pred) for r in refs) / len(refs)


def score(task: str, pred: str, refs: tuple[str, ...] | list[str]) -> float:
    """Score in [0, 1] of one output.

    Single-answer tasks (passkey, niah_single, niah_multikey) are right or
    wrong; multi-answer tasks (niah_multivalue, vt, cwe) earn the fraction of
    the answers given. For passkey and the needle tasks a number that merely
    contains the answer does not count, and, for single-answer tasks, neither
    does an answer buried after other candidates: the first number given must
    be the right one (a model listing every number it saw gets no credit).
    """
    if task in ("passkey", "niah_single", "niah_multikey"):
        nums = re.findall(r"\d+", pred)
        if nums:
            return 1.0 if nums[0] == refs[0] else 0.0
        return string_match_all(pred, refs)
    return string_match_all(pred, refs)


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    """log p(token) under the logits (numerically stable)."""
    x = logits.astype(np.float64)
    m = float(x.max())
    return float(x[token] - m - math.log(np.exp(x - m).sum()))


def perplexity(nll_sum: float, n: int) -> float:
    return math.exp(nll_sum / n) if n else float("nan")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 log-probabilities of one position's logits (computed in float64)."""
    x = logits.astype(np.float64)
    x = x - x.max()
    return (x - math.log(np.exp(x).sum())).astype(np.float32)


def kl_top1(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """Mean KL(ref || got) in nats and the fraction of positions whose most likely token agrees,
    over [positions, vocab] log-probabilities (llama-perplexity --kl-divergence's two numbers)."""
    p = ref.astype(np.float64)
    terms = np.exp(p) * (p - got.astype(np.float64))
    kl = np.where(np.isfinite(p), terms, 0.0).sum(axis=1)  # tokens the reference gives no mass add nothing
    top1 = ref.argmax(axis=1) == got.argmax(axis=1)
    return float(np.maximum(kl, 0.0).mean()), float(top1.mean())
