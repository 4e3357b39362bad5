"""Chelsea ("Efficient Long-Context LLM Inference via KV Cache Clustering",
arXiv:2506.11418; notes in docs/methods.md).

Neighbouring keys of one head are often nearly parallel, so a group of them
can be replaced by one centroid that stands for all of them. Chelsea finds the
groups with Chunked Soft Matching, per (layer, KV head): the cells between the
sinks and the recent window are cut into chunks of ``chunk`` cells; inside a
chunk the 1st, 3rd, 5th ... cells are sources and the 2nd, 4th ... are
destinations; every source draws one edge to its most similar destination of
the same chunk (cosine of the cached keys); the ``m`` best edges of the whole
head are merged. Merged keys and values are count-weighted means, so a
centroid is always the mean of the tokens it absorbed, and attention adds
log(count) to its logit, which gives a group of identical keys exactly the
weight of its members (the log-count bias, native engine only). One
compression runs steps at a decaying rate ``r`` (a share of the cells between
sinks and window, at most half) until the target is met; the last step is cut
to land on it.

edgekv's choices where the paper is silent (docs/methods.md): the rate
schedule restarts at every compression (after a prefill the large first
compression decays as in the paper; a decode-time compression of ``interval``
cells is one step once the middle holds ``interval / r_init`` cells); survivors keep their order; the paper's
outlier heads, which keep a full cache, cannot exist in a cache where every
head holds the same number of cells, so all heads are merged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from numba import njit

from ..errors import BudgetError
from ..gguf_info import ModelInfo
from ..kvcache.engine import KVEngine
from ..kvcache.snapshot import KVSnapshot
from .base import Method, Why, map_layers
from .pairwise import sum_squares_own

if TYPE_CHECKING:
    from ..config import BudgetRule


@dataclass
class Chelsea(Method):
    """Merge similar neighbouring cells into centroids; attention weighs them by their counts."""

    name = "chelsea"
    summary = "merge similar neighbouring keys into centroids with a log-count bias (Hu et al. 2025)"
    needs = frozenset({"merge", "bias"})
    bias: ClassVar[bool] = True  # attention adds log(count) of merged cells

    sinks: int = 16
    window: int = 64
    chunk: int = 256  # cells per matching chunk
    r_init: float = 0.35  # merge rate of the first step (share of the cells between sinks and window)
    r_decay: float = 0.10  # the rate falls by this much per step ...
    r_steps: int = 2  # ... for this many steps (the paper's Llama-3.1 schedule)
    r_floor: float = 0.05
    interval: int = 64  # with a budget: compress when the cache is this far above it

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk < 2:
            raise ValueError(f"chunk must hold at least a source and a destination, got {self.chunk}")
        if not 0.0 < self.r_floor <= 0.5 or not 0.0 < self.r_init <= 0.5:
            raise ValueError("r_init and r_floor are shares of the cells merged per step, in (0, 0.5]")
        if self.r_decay < 0 or self.r_steps < 0:
            raise ValueError("r_decay and r_steps must not be negative")
        if self.interval < 1 or self.sinks < 0 or self.window < 1:
            raise ValueError("interval and window must be positive, sinks not negative")
        self._budget: int | None = None

    def bind(self, rule: BudgetRule) -> None:
        self._budget = rule.budget

    def attach(self, info: ModelInfo) -> None:
        # numba's first call in a process loads the kernel: at the Session's start, not in
        # the first compression
        edges(np.ones((1, 2, 4), np.float32), 2)

    def due(self, tokens_since_compress: int, n_cells: int) -> bool:
        return self._budget is not None and n_cells >= self._budget + self.interval

    def rate(self, step: int) -> float:
        """The share of the middle cells step ``step`` of one compression merges away."""
        r = round(self.r_init - self.r_decay * min(self.r_steps, step), 9)  # 0.35 - 0.1 is 0.2499...
        return min(0.5, max(self.r_floor, r))

    def compress(self, engine: KVEngine, target: int, *, why: Why = "call") -> int:
        step = 0
        while engine.n_cells > target:
            snap = engine.snapshot()
            middle = self.middle(snap)
            m = min(max(1, math.floor(self.rate(step) * middle.shape[2])), snap.n_cells - target)
            src, dst = match(snap, middle, self.chunk, m)
            if src is None:
                raise BudgetError(f"budget {target} is below what {self.name} can reach: it keeps "
                                  f"sinks={self.sinks} and window={self.window} and merges at most half "
                                  f"of the {middle.shape[2]} cells between them per step")
            engine.merge(src, dst, bias=self.bias)
            step += 1
        return 0

    def middle(self, snap: KVSnapshot) -> np.ndarray:
        """int [L, H, M]: the cells between sinks and window, per (layer, head), in order
        (M: the fewest any head has; a head with more leaves its newest ones out)."""
        free = ~self.protected(snap)
        m = int(free.sum(axis=2).min())
        idx = np.argsort(~free, axis=2, kind="stable")[:, :, :m]
        return np.sort(idx, axis=2)


def edges(keys: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Chunked soft matching on keys [..., M, d] (cells in order; leading axes: heads
    matched at once): for every source (1st, 3rd, ... cell of its chunk) its most
    similar destination (2nd, 4th, ...) of the same chunk by cosine. Returns (source
    [E], destination [..., E], score [..., E]) as indices into the M cells; a source
    alone in its chunk has no edge."""
    *lead, M, d = keys.shape
    n_chunk = -(-M // chunk)
    dtype = np.result_type(keys.dtype, np.float32)
    unit = np.empty((*lead, n_chunk * chunk, d), dtype)  # the last chunk padded (with zeros)
    flat = unit.reshape(-1, n_chunk * chunk, d)
    _unit_rows_into(np.ascontiguousarray(keys, dtype).reshape(-1, M, d), flat, dtype.type(1e-12))
    unit = unit.reshape(*lead, n_chunk, chunk, d)
    idx = np.arange(n_chunk * chunk).reshape(n_chunk, chunk)
    a, b = idx[:, 0::2], idx[:, 1::2]
    sim = unit[..., 0::2, :] @ np.swapaxes(unit[..., 1::2, :], -1, -2)  # [..., chunks, sources, destinations]
    sim[..., -1, :, b[-1] >= M] = -np.inf  # padding is no destination (only the last chunk has any)
    best = sim.argmax(axis=-1)
    score = np.take_along_axis(sim, best[..., None], axis=-1)[..., 0]
    dst = b[np.arange(n_chunk)[:, None], best]
    ok = (a < M) & (b[:, :1] < M)  # a real source with at least one destination in its chunk
    return a[ok], dst[..., ok], score[..., ok]


@njit(cache=True, nogil=True)
def _unit_rows_into(keys, out, tiny):  # pragma: no cover - compiled
    """out[h, :M] = keys[h] / max(||row||, tiny) in the keys' own type, and zeros after
    them: numpy's ``np.divide(keys, np.maximum(np.linalg.norm(keys, axis=-1), tiny))``,
    the same floats (a float32 norm is summed in float32, as numpy sums it), in one pass
    instead of numpy's three over the keys (their norms, the maximum, the division)."""
    n_lead, M, d = keys.shape
    flat = keys.reshape(n_lead * M * d)
    for h in range(n_lead):
        for t in range(M):
            lo = (h * M + t) * d
            norm = np.sqrt(sum_squares_own(flat, lo, d))
            norm = norm if not norm < tiny else tiny  # np.maximum: a NaN norm stays NaN
            for c in range(d):
                out[h, t, c] = keys[h, t, c] / norm
        out[h, M:] = 0


def match(snap: KVSnapshot, middle: np.ndarray, chunk: int, m: int) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
    """The ``m`` best edges of every (layer, KV head), as cell indices (src, dst) [L, H, m];
    (None, None) when there are fewer than ``m`` edges. Ties go to the earlier source.
    Layers are matched side by side (``map_layers``): each reads its own keys."""
    L, H, M = middle.shape
    src = np.empty((L, H, m), np.int64)
    dst = np.empty((L, H, m), np.int64)
    heads = np.arange(H)[:, None]

    def one(layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        cells = middle[layer]  # [H, M]
        keys = snap.keys(layer)[cells, heads].astype(np.float32, copy=False)  # [H, M, d]
        snap.release(layer)  # a copy is taken: the read's buffer serves the next layers
        a, b, score = edges(keys, chunk)
        if a.size < m:
            return None
        top = np.argsort(-score, axis=1, kind="stable")[:, :m]
        return (np.take_along_axis(cells, a[top], axis=1),
                np.take_along_axis(cells, np.take_along_axis(b, top, axis=1), axis=1))

    for layer, pair in map_layers(one, L, parallel=True, fetch=snap.prefetch):
        if pair is None:
            return None, None
        src[layer], dst[layer] = pair
    return src, dst
