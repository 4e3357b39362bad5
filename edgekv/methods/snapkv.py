"""SnapKV ("SnapKV: LLM Knows What You are Looking for Before Generation",
arXiv:2404.14469; notes in docs/methods.md).

The newest ``window`` queries (the observation window) vote for the cached
keys they attend to: per KV head, the softmax attention of every window query
and every query head of the GQA group, averaged over the window's queries and
the group, smoothed by an average pool of ``kernel`` cells (zero padding,
stride 1), over the cells before the window. The window itself is always kept.
Defaults as kvpress 0.5's ``SnapKVPress`` (window 64, kernel 5, no sinks), so
the kept sets can be compared; the paper pools with max over a kernel of 7 and
a window of 32 (its code), and selects per query head, which a GQA cache
cannot store.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kvcache.snapshot import KVSnapshot
from .base import ScorerMethod


def avg_pool(x: np.ndarray, kernel: int) -> np.ndarray:
    """Mean over ``kernel`` neighbours along the last axis, zeros beyond the edges
    (torch's avg_pool1d with padding kernel // 2, stride 1, count_include_pad)."""
    if kernel <= 1 or x.shape[-1] == 0:
        return x
    pad = kernel // 2
    c = np.cumsum(np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad + 1, pad)]), axis=-1)
    n = x.shape[-1] + 2 * pad - kernel + 1
    return (c[..., kernel : kernel + n] - c[..., :n]) / kernel


@dataclass
class SnapKV(ScorerMethod):
    """Keep the cells the observation window attends to most, per (layer, KV head)."""

    name = "snapkv"
    summary = "keep what the newest queries attend to, pooled (Li et al. 2024)"
    needs = frozenset({"queries"})

    sinks: int = 0
    window: int = 64
    kernel: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        check_window(self.window, self.kernel)

    @property
    def queries_needed(self) -> int:
        return self.window

    def score(self, snap: KVSnapshot, layer: int) -> np.ndarray:
        s = snapkv_scores(snap, layer, self.window, self.kernel)
        return np.concatenate([s, np.full((snap.n_kv_head, snap.n_cells - s.shape[1]), np.inf)], axis=1)


def check_window(window: int, kernel: int) -> None:
    """An observation window needs queries, and a centred pool an odd kernel."""
    if window < 1:
        raise ValueError(f"window must be at least 1 (the observation window), got {window}")
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"kernel must be odd and positive (a centred pool), got {kernel}")


def snapkv_scores(snap: KVSnapshot, layer: int, window: int, kernel: int) -> np.ndarray:
    """SnapKV's scores of the cells before the window, float [n_kv_head, n - window]:
    the window's attention averaged over its queries and each KV head's query heads,
    then the average pool (kvpress's values exactly, so ChunkKV's per-layer mode can
    add its window padding on the same scale)."""
    n = snap.n_cells
    w = min(window, n)
    n_q = min(window, snap.queries.n) if snap.queries is not None else window
    group = snap.queries.n_head // snap.n_kv_head if snap.queries is not None else 1
    a = snap.window_attention(layer, window)[:, : n - w] / (n_q * group)
    return avg_pool(a, kernel)
