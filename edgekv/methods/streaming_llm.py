from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kvcache.snapshot import KVSnapshot
from .base import ScorerMethod


@dataclass
class StreamingLLM(ScorerMethod):
    """StreamingLLM (Xiao et al., 2023): attention sinks plus the most recent
    tokens. Scoring by recency makes every (layer, head) keep the same
    tokens, so this is also what a whole-cell eviction would do."""

    name = "streaming_llm"
    summary = "attention sinks + most recent tokens (Xiao et al. 2023)"

    sinks: int = 4

    def score(self, snap: KVSnapshot, layer: int) -> np.ndarray:
        return snap.token_pos[layer].astype(np.float64)
