from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kvcache.snapshot import KVSnapshot
from .base import ScorerMethod


@dataclass
class Random(ScorerMethod):
    """The control: uniform random scores per (layer, head). A method that does
    not beat this at the same budget is not selecting anything useful."""

    name = "random"
    summary = "uniformly random tokens per layer and KV head (control)"

    seed: int = 0

    def score(self, snap: KVSnapshot, layer: int) -> np.ndarray:
        # Seeded by layer and cache size so repeated compressions differ but runs reproduce.
        rng = np.random.default_rng((self.seed, layer, snap.n_cells))
        return rng.random((snap.n_kv_head, snap.n_cells))
