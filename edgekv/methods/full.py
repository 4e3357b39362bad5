from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kvcache.snapshot import KVSnapshot
from .base import Method, Why


@dataclass
class Full(Method):
    """The uncompressed baseline: never removes anything. When the context is
    full, generation stops with an error, as plain llama.cpp without context
    shift does."""

    name = "full"
    summary = "no compression (reference); the cache grows until n_ctx"
    compresses = False

    def select(self, snap: KVSnapshot, budget: int, *, why: Why = "call") -> np.ndarray:
        n = snap.n_cells
        return np.broadcast_to(np.arange(n), (snap.n_layer, snap.n_kv_head, n)).copy()
