"""``NAME+chunk@C``: a scorer's choice made span by span (kvpress's ``ChunkKVPress``
applies its chunks to any scorer; edgekv's ``chunkkv`` only to window attention).

A per-token score ranks each token alone, and at a tight budget every head keeps a
different subset of a number's digits or a name's pieces (bench/RESULTS.md: on SmolLM2
at ratio 0.5 only a fifth to a quarter of the (layer, KV head)s keep a whole 7-token
needle). Here each head's cells, in position order, are cut into runs of ``chunk``
cells, every cell scores its run's mean (over the cells the wrapped method scored; the
ones it protects stay kept), and the usual top-k keeps whole runs, best first, with
the earliest cells of the run at the cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import EdgekvError
from ..kvcache.engine import KVEngine
from ..kvcache.snapshot import KVSnapshot
from .base import Method, ScorerMethod, Why
from .wrapper import MethodWrapper


def chunk_means(s: np.ndarray, chunk: int) -> np.ndarray:
    """float64 [H, n]: each cell's score replaced by the mean of the finite scores of its run
    of ``chunk`` cells; infinite scores (cells kept regardless) stay as they are."""
    h, n = s.shape
    finite = np.isfinite(s)
    starts = np.arange(0, n, chunk)
    total = np.add.reduceat(np.where(finite, s, 0.0), starts, axis=1)
    count = np.add.reduceat(finite.astype(np.int64), starts, axis=1)
    mean = np.divide(total, count, out=np.full_like(total, -np.inf), where=count > 0)
    return np.where(finite, np.repeat(mean, chunk, axis=1)[:, :n], s)


@dataclass
class ChunkSelection(MethodWrapper, ScorerMethod):
    """Keeps the wrapped scorer's best runs of ``chunk`` cells per (layer, KV head)."""

    suffix = "chunk"
    arg = "chunk"
    about = "NAME's scores averaged over runs of N cells (NAME+chunk@N, default 8), whole runs kept best first"

    chunk: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.method, ScorerMethod):
            raise EdgekvError(f"{self.method.name} chooses its cells itself; +chunk takes a method that scores "
                              "them (kvzip, expected_attention, knorm, snapkv, ...)")
        if not isinstance(self.chunk, int) or isinstance(self.chunk, bool) or self.chunk < 1:
            raise EdgekvError(f"the chunk must be a whole number of cells >= 1 (NAME+chunk@N), got {self.chunk!r}")

    @property
    def summary(self) -> str:  # type: ignore[override]
        return f"{self.method.summary}; kept in whole runs of {self.chunk} cells"

    def score(self, snap: KVSnapshot, layer: int) -> np.ndarray:
        return chunk_means(np.asarray(self.method.score(snap, layer), np.float64), self.chunk)

    def select(self, snap: KVSnapshot, budget: int, *, why: Why = "call") -> np.ndarray:
        return ScorerMethod.select(self, snap, budget, why=why)

    def compress(self, engine: KVEngine, target: int, *, why: Why = "call") -> int:
        if target >= engine.n_cells:
            return 0  # nothing to evict (and KVzip's pass is not run for nothing)
        return Method.compress(self, engine, target, why=why)
