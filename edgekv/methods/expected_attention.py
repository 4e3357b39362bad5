"""Expected Attention (kvpress's ``ExpectedAttentionPress``; Devoto et al. 2025,
"Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution", arXiv:2510.00636; notes in docs/methods.md).

In a chat the cache is compressed before the next question exists, so no query can
vote for the keys it will need. Expected Attention predicts them instead: it models the
coming queries as Gaussian, with the mean ``mu`` and covariance ``S`` of every query the
context produced *before RoPE* (the engine keeps these sums, ``QueryMoments``), rotated
by RoPE averaged over the next ``n_future_positions`` positions (``R``). For a Gaussian
q, the expected unnormalised attention to a cached key k is

    E[exp(s q.k)] = exp(s k.(R mu) + s^2 k^T (R S R^T) k / 2),     s = the model's kq_scale

(1/sqrt(d) for most models: kvpress's formula). These logits are softmaxed over the
cells each head holds, beside the sinks, averaged over the query heads of a KV head's
GQA group and multiplied by the value's norm (what the token would write into the
output). Sinks are kept. No observation window: every cell is scored, so the newest
cell is the only one kept regardless (edgekv's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from .. import kernels
from ..errors import EdgekvError
from ..gguf_info import ModelInfo
from ..kvcache.snapshot import KVSnapshot
from .base import ScorerMethod
from .pairwise import sum_squares

# Cells a pass for numpy's covariance term, where the host kernel cannot run: its sums run
# over channels only, so a chunk's scores are the whole layer's to float32's rounding
# (tested; bit for bit where the BLAS sums a row's products in one order whatever the row
# count, which OpenBLAS's AVX2 sgemm does not), and a chunk's [chunk, group * d] products
# stay in cache. The mean term stays one pass: a float64 product of three query heads and a
# chunk of cells is small enough for OpenBLAS's small-matrix kernels, which sum in another
# order.
CHUNK = 1024


@dataclass
class ExpectedAttention(ScorerMethod):
    """Keep the cells that queries like the context's own are expected to attend to."""

    name = "expected_attention"
    summary = "keep what future queries are expected to attend to, from past queries' statistics (kvpress)"
    needs = frozenset({"queries"})
    query_statistics = True
    parallel = True  # numpy on each layer's K/V: layers are scored side by side

    sinks: int = 4
    window: int = 0
    n_future_positions: int = 512  # the coming positions RoPE is averaged over
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0  # added to the attention before the value norm scales it

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_future_positions < 1:
            raise ValueError(f"n_future_positions must be at least 1, got {self.n_future_positions}")
        if self.epsilon < 0:
            raise ValueError(f"epsilon must not be negative, got {self.epsilon}")

    def attach(self, info: ModelInfo) -> None:
        # numba's first call in a process (0.2 to 0.6 s) at the Session's start, not at the
        # first compression
        value_norms(np.zeros((1, 1, 8), np.float32))

    def fetch(self, snap: KVSnapshot, layer: int) -> None:
        # V only where the engine cannot norm it in place (every layer's norms in its first call)
        snap.prefetch(layer, values=self.use_vnorm and snap.value_norms(layer) is None)

    def score(self, snap: KVSnapshot, layer: int) -> np.ndarray:
        m = snap.moments
        if m is None:
            raise EdgekvError("expected_attention needs the statistics of the context's queries, which the "
                              "engine was not keeping when it was filled (use the method from the start, "
                              "or Session(..., moments=True))")
        mu, cov = m.mean_cov(layer)
        first = int(snap.pos.max()) + 1 if snap.n_cells else 0  # where the coming queries sit
        rot = m.future_rotation(layer, first, self.n_future_positions)
        vnorm = None
        if self.use_vnorm:
            vnorm = snap.value_norms(layer)
            if vnorm is None:
                vnorm = value_norms(snap.values(layer))
        return expected_attention_scores(
            mu @ rot.T, rot @ cov @ rot.T if self.use_covariance else None, snap.keys(layer), vnorm,
            snap.token_pos[layer] >= self.sinks, snap.kq_scale, snap.log_counts(layer), self.epsilon)


def expected_attention_scores(mu: np.ndarray, cov: np.ndarray | None, k: np.ndarray, vnorm: np.ndarray | None,
                              scored: np.ndarray, kq_scale: float, bias: np.ndarray | None = None,
                              epsilon: float = 0.0) -> np.ndarray:
    """float64 [n_kv_head, n]: Expected Attention's score of every cell of one layer.

    ``mu`` [n_head, d] and ``cov`` [n_head, d, d] (None: the mean alone): the future
    queries' statistics, already rotated; ``k`` [n, n_kv_head, d] post-RoPE keys and
    ``vnorm`` [n, n_kv_head] the values' norms (``value_norms``; None: no value norm);
    ``scored`` bool [n_kv_head, n]: the
    cells the softmax runs over (not the sinks; others score +inf, to be kept); ``bias``
    [n_kv_head, n]: merged cells' log counts, added to the logits as attention adds them."""
    n_head, d = mu.shape
    n, n_kv, _ = k.shape
    if n_head % n_kv:
        raise EdgekvError(f"{n_head} query heads do not split into {n_kv} KV heads")
    group = n_head // n_kv
    out = np.full((n_kv, n), np.inf)
    for h in range(n_kv):
        cols = np.flatnonzero(scored[h])
        if cols.size == 0:
            continue
        if cols[-1] - cols[0] + 1 == cols.size:  # the usual case (all but the sinks): a slice, not a gather
            cols = slice(int(cols[0]), int(cols[-1]) + 1)
        heads = slice(h * group, (h + 1) * group)
        # the head's keys out of the layer's interleaved rows once, for both terms (a view
        # where the engine hands each head's rows out together)
        kh = np.ascontiguousarray(k[cols, h])
        logits = expected_logits(kh, mu[heads], None if cov is None else cov[heads], kq_scale)  # [group, c]
        if bias is not None:
            logits += bias[h, cols]
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        s = p.mean(axis=0)
        if vnorm is not None:
            s = (s + epsilon) * vnorm[cols, h]
        out[h, cols] = s
    return out


def expected_logits(k: np.ndarray, mu: np.ndarray, cov: np.ndarray | None, kq_scale: float) -> np.ndarray:
    """float64 [g, n]: ``s mu_h . k_i + s^2 / 2 k_i^T C_h k_i`` for every key of ``k`` [n, d]
    and each query head of ``mu`` [g, d] and ``cov`` [g, d, d] (None: the mean term alone).
    The host kernel where it runs (one pass over the keys, the covariance term over each
    matrix's upper triangle); else numpy: the mean term a float64 product, the covariance
    term float32 products [chunk, d] x [d, g * d]. The two sum in other orders, so their
    floats differ in the last bits (tested against float64)."""
    if cov is not None and k.dtype == np.float32:
        logits = kernels.expected_logits(k, mu, cov, kq_scale)
        if logits is not None:
            return logits
    logits = kq_scale * (mu @ k.astype(np.float64).T)
    if cov is not None:
        g, d, _ = cov.shape
        covs = cov.transpose(1, 0, 2).reshape(d, g * d).astype(np.float32)
        for c0, c1 in _chunks(k.shape[0]):
            k32 = np.ascontiguousarray(k[c0:c1], np.float32)  # float32 keys: a view
            # one batched product [c, g, d] x [c, d, 1] (what numpy 2.4's
            # einsum("cgd,cd->gc", optimize=True) runs, without parsing it per call)
            quad = np.matmul((k32 @ covs).reshape(-1, g, d), k32[:, :, None])[:, :, 0].T
            logits[:, c0:c1] += 0.5 * kq_scale**2 * quad.astype(np.float64)
    return logits


def _chunks(n: int) -> list[tuple[int, int]]:
    """[c0, c1) runs of CHUNK cells, the last one taking the rest (CHUNK to 2 * CHUNK - 1
    cells), so that no product is small enough for OpenBLAS's small-matrix kernels, whose
    sums run in another order."""
    ends = list(range(CHUNK, n - CHUNK + 1, CHUNK)) + [n]
    return list(zip([0] + ends[:-1], ends, strict=True))


def value_norms(v: np.ndarray) -> np.ndarray:
    """float64 [n, n_kv_head]: ``np.linalg.norm(v.astype(np.float64), axis=2)``, the same
    floats (tested), in one compiled pass over the float32 values: numpy's float64 copy
    and its squares cost more than the sums."""
    out = np.empty(v.shape[:2])
    _norms_into(np.ascontiguousarray(v, np.float32), out)
    return out


@njit(cache=True, nogil=True)
def _norms_into(v, out):  # pragma: no cover - compiled
    n, h, d = v.shape
    flat = v.reshape(n * h * d)
    for i in range(n):
        for j in range(h):
            out[i, j] = np.sqrt(sum_squares(flat, (i * h + j) * d, d))
