from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kvcache.snapshot import KVSnapshot
from .base import ScorerMethod


@dataclass
class Knorm(ScorerMethod):
    """Keep the keys with the LOWEST L2 norm, per layer and KV head (Devoto et
    al., 2024: low key norm correlates with high attention). Needs only the
    cached keys, so it works with flash attention and quantised caches."""

    name = "knorm"
    summary = "keep lowest key-norm tokens per layer and KV head (Devoto et al. 2024)"

    def score(self, snap: KVSnapshot, layer: int) -> np.ndarray:
        return -snap.key_norms(layer)
