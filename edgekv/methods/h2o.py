"""H2O ("H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", arXiv:2306.14048; notes in docs/methods.md).

A few tokens collect most of the attention, and keep collecting it: the
"heavy hitters". The engine tallies, per (layer, KV head, cell), the softmax
attention every decoded query pays to every cell before it (prefill chunks
and generated tokens alike; the GQA group's query heads summed). A
compression keeps the newest ``recent`` share of the budget and fills the rest
with the highest tallies. The paper splits the budget evenly between heavy
hitters and recent tokens (``recent=0.5``) and evicts at every generated
token; edgekv compresses when the cache is full, down to the budget.

The tally is an accumulated sum, so old tokens have had more queries to
collect from than new ones: the recent share is what protects the new ones.
Keeping it costs an attention pass per decode (on the device for the native
engine, in numpy for the state engine); bench/RESULTS.md has the decode cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..errors import EdgekvError
from ..kvcache.snapshot import KVSnapshot
from .base import ScorerMethod, Why


@dataclass
class H2O(ScorerMethod):
    """Keep the recent tokens and the heavy hitters of accumulated attention."""

    name = "h2o"
    summary = "keep recent tokens + heavy hitters of accumulated attention (Zhang et al. 2023)"
    needs = frozenset({"queries"})
    tallies = True

    sinks: int = 0
    window: int = 32  # at least this many newest cells, whatever the budget
    recent: float = 0.5  # share of the budget for the newest cells

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.recent < 1.0:
            raise ValueError(f"recent is a share of the budget in [0, 1), got {self.recent}")

    @property
    def queries_needed(self) -> int:
        return 1

    def select(self, snap: KVSnapshot, budget: int, *, why: Why = "call") -> np.ndarray:
        newest = max(self.window, math.floor(budget * self.recent))
        return ScorerMethod.select(replace(self, window=newest), snap, budget, why=why)

    def score(self, snap: KVSnapshot, layer: int) -> np.ndarray:
        if snap.tally is None:
            raise EdgekvError("h2o needs the attention of every query since the sequence began, and the "
                              "engine's tally started later (use h2o from the start, or Session(..., tally=True))")
        return snap.tally[layer]
