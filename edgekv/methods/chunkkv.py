"""ChunkKV ("ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
Long-Context LLM Inference", arXiv:2502.00299; notes in docs/methods.md).

Eviction by chunks of ``chunk`` consecutive tokens instead of single tokens,
so a kept fact keeps its subject, verb and object. The paper's rule
(``per_layer=False``), per (layer, KV head):

- every cell before the window is scored by the attention the window's
  queries pay to it (softmax, summed over the window queries and the query
  heads of the KV head's GQA group; no pooling, as the paper);
- cells are grouped into chunks by original position (token_pos // chunk: the
  paper's grid over the prompt), a chunk scores the sum of its cells;
- chunks are kept whole, best first, while they fit the budget left after the
  protected cells (sinks and the ``window`` newest); the budget must be the
  same for every head, so the first chunk that does not fit gives its best
  cells to fill it (the paper leaves those (budget - window) mod chunk cells
  unused instead).

``per_layer=True`` (the default) is kvpress's ``ChunkKVPress`` over
``SnapKVPress``: the token scores are SnapKV's (mean over window queries,
average pool of ``kernel``, GQA group mean), summed over the layer's KV heads;
a chunk scores the mean of its cells over the whole cache (window included,
the window scoring the layer's maximum + 1), and every head of the layer keeps
the same chunks. The defaults (chunk 20, window 64, kernel 5) are kvpress's:
in edgekv's own query-agnostic sweep (n = 20) this configuration kept more
than the paper's per-head one on both models measured (bench/RESULTS.md).
``per_layer=False chunk=10 window=32`` is the per-head rule described above.

``reuse=N`` is the paper's layer-wise index reuse: layers are taken in groups
of N, the first layer of each group is scored and selects, the others keep
the same cells (per head) without being scored, so the scoring cost drops by
about N. Default 1 (off), as in the paper's quality tables; it uses 2 when on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import BudgetError
from ..kvcache.snapshot import KVSnapshot
from .base import Method, Why
from .snapkv import check_window, snapkv_scores


@dataclass
class ChunkKV(Method):
    """Keep whole chunks of consecutive tokens, ranked by window attention."""

    name = "chunkkv"
    summary = "keep whole chunks of tokens ranked by window attention, optional layer reuse (Liu et al. 2025)"
    needs = frozenset({"queries"})

    sinks: int = 0
    window: int = 64
    chunk: int = 20
    reuse: int = 1
    per_layer: bool = True
    kernel: int = 5  # per_layer mode only (SnapKV's pooling)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_window(self.window, self.kernel)
        if self.chunk < 1 or self.reuse < 1:
            raise ValueError("chunk and reuse must be at least 1")

    @property
    def queries_needed(self) -> int:
        return self.window

    def select(self, snap: KVSnapshot, budget: int, *, why: Why = "call") -> np.ndarray:
        n, L, H = snap.n_cells, snap.n_layer, snap.n_kv_head
        if budget >= n:
            return np.broadcast_to(np.arange(n), (L, H, n)).copy()
        prot = self.protected(snap)
        self.refuse_below(budget, int(prot.sum(axis=2).max()))
        keep = np.empty((L, H, budget), dtype=np.int64)
        for leader in range(0, L, self.reuse):
            if self.per_layer:
                chunk_of = np.broadcast_to(np.arange(n) // self.chunk, (H, n))
                cell = self._layer_scores(snap, leader)
                sel = _fill(np.broadcast_to(cell, (1, n)), chunk_of[:1], prot[leader].any(axis=0)[None],
                            budget, mean=True)
                sel = np.broadcast_to(sel, (H, budget))
            else:
                cell = snap.window_attention(leader, self.window)
                sel = _fill(cell, snap.token_pos[leader] // self.chunk, prot[leader], budget, mean=False)
            keep[leader : leader + self.reuse] = sel
        return keep

    def _layer_scores(self, snap: KVSnapshot, layer: int) -> np.ndarray:
        """kvpress's scores of one layer, summed over its KV heads: float [n]. SnapKVPress
        pads the window with the layer's maximum score + 1 (kvpress 0.5.5)."""
        s = snapkv_scores(snap, layer, self.window, self.kernel)
        pad = (s.max() if s.size else 0.0) + 1.0
        full = np.concatenate([s, np.full((snap.n_kv_head, snap.n_cells - s.shape[1]), pad)], axis=1)
        return full.sum(axis=0)


def _fill(cell: np.ndarray, chunk_of: np.ndarray, prot: np.ndarray, budget: int, *, mean: bool) -> np.ndarray:
    """Per row (head): protected cells, then whole chunks best first, then the best
    cells of the first chunk that no longer fits, up to exactly ``budget`` cells.

    ``cell`` [rows, n] scores, ``chunk_of`` [rows, n] chunk ids, ``prot`` [rows, n].
    A chunk scores the sum of its unprotected cells (the paper's grid over the prefix
    before the window), or with ``mean`` the mean of all its cells (kvpress, whose
    window cells score high and pull their chunks in); ties go to the earlier chunk."""
    rows, n = cell.shape
    out = np.empty((rows, budget), dtype=np.int64)
    for r in range(rows):
        taken = prot[r].copy()
        room = budget - int(taken.sum())
        if room < 0:
            raise BudgetError(f"budget {budget} is below the {int(taken.sum())} protected cells")
        free = ~taken
        ids, inv = np.unique(chunk_of[r], return_inverse=True)
        if mean:
            tot = np.bincount(inv, weights=cell[r], minlength=ids.size) / np.bincount(inv, minlength=ids.size)
        else:
            tot = np.bincount(inv, weights=np.where(free, cell[r], 0.0), minlength=ids.size)
        # the free cells of each chunk, contiguous in ``members``
        members = np.flatnonzero(free)
        members = members[np.argsort(inv[members], kind="stable")]
        bounds = np.searchsorted(inv[members], np.arange(ids.size + 1))
        for c in np.argsort(-tot, kind="stable"):
            if room == 0:
                break
            m = members[bounds[c] : bounds[c + 1]]
            if m.size > room:  # the partial chunk: its best cells, earlier first on ties
                m = m[np.argsort(-cell[r, m], kind="stable")[:room]]
            taken[m] = True
            room -= m.size
        out[r] = np.flatnonzero(taken)
    return out
