from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kvcache.engine import KVEngine
from ..kvcache.snapshot import KVSnapshot
from .base import Method, Why


@dataclass
class ContextShift(Method):
    """llama.cpp's own answer to a full context, as llama-cli/llama-server do it:
    keep the first ``n_keep`` tokens, discard the older half of the rest, and
    shift the survivors' positions down (``llama_memory_seq_rm`` +
    ``llama_memory_seq_add``, which re-rotates the cached keys). Unlike every
    other method here it changes positions, so its ``compress`` runs through
    llama.cpp's memory API instead of a compaction; ``select`` only says which
    cells survive. ``n_keep=1`` stands for llama.cpp keeping the BOS token.
    The budget is ignored: each event halves the cache, as llama.cpp does."""

    name = "context_shift"
    summary = "llama.cpp context shift: keep n_keep, drop the older half, shift positions"
    shifts_positions = True

    n_keep: int = 1
    sinks: int = 0
    window: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.n_keep, bool) or not isinstance(self.n_keep, int) or self.n_keep < 0:
            raise ValueError(f"n_keep must be a whole number >= 0, got {self.n_keep!r}")
        if (self.sinks, self.window) != (0, 1):  # fixed: what llama.cpp keeps is n_keep and the newer half
            raise ValueError("sinks and window do not apply to context_shift: it keeps the first n_keep "
                             "tokens and the newer half of the rest (set n_keep)")

    def n_discard(self, n_cells: int) -> int:
        return max(0, (n_cells - self.n_keep) // 2)

    def compress(self, engine: KVEngine, target: int, *, why: Why = "call") -> int:
        """llama.cpp's memory API moves the survivors down: positions shift by -delta."""
        return -engine.shift(self.n_keep, self.n_discard(engine.n_cells))

    def select(self, snap: KVSnapshot, budget: int, *, why: Why = "call") -> np.ndarray:
        n = snap.n_cells
        d = self.n_discard(n)
        idx = np.concatenate([np.arange(min(self.n_keep, n)), np.arange(self.n_keep + d, n)])
        return np.broadcast_to(idx, (snap.n_layer, snap.n_kv_head, idx.size)).copy()
