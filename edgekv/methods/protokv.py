"""ProtoKV ("ProtoKV: A Hybrid Semantic Prototype-based Framework for Efficient
KV Cache Compression", an anonymous ACL submission with no arXiv id; notes in
docs/methods.md).

SnapKV's observation-window vote, smoothed over clusters of keys instead of
over neighbouring positions. Per (layer, KV head), over the cells before the
window (the eviction candidates), with no iteration:

- the candidates are cut into ``k = max(1, n // chunk)`` consecutive chunks
  (the remainder joins the last one); a key's irregularity is how far its
  direction leaves its chunk's mean, over the chunk's spread, and the ``p``
  most irregular keys of the whole head are set apart;
- each chunk's other (regular) keys, summed and normalised, give one
  prototype; the irregular keys are hashed into ``buckets`` buckets by the
  signs of random Fourier features, and each bucket gives one prototype;
- every candidate joins the prototype most similar in direction, and its score
  becomes the mean window vote of its cluster, ties broken by its own vote.

The window is always kept; nothing is merged (the prototypes only steer the
scoring). The paper fixes only ``p = 3 * buckets``; the other defaults are
edgekv's choices (docs/methods.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from .. import kernels
from ..gguf_info import ModelInfo
from ..kvcache.snapshot import KVSnapshot
from .base import ScorerMethod
from .pairwise import sum_products, sum_squares
from .snapkv import check_window


def chunk_bounds(n: int, chunk: int) -> np.ndarray:
    """int [k + 1] boundaries of ``k = max(1, n // chunk)`` consecutive chunks of
    ``n // k`` cells, the remainder in the last: the paper's equal split, with ``k``
    following ``n`` so that the clusters stay small next to the budget."""
    k = max(1, n // chunk)
    return np.append(np.arange(k) * (n // k), n).astype(np.int64)


def irregularity(x: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """float [n]: (1 - cos(x_t, chunk mean)) / ||chunk std|| per row of ``x`` [n, d]
    (chunks ``bounds[i]:bounds[i+1]``).

    A key that points away from its chunk, in a chunk whose keys barely spread,
    is the kind the positional chunks cannot explain. Guards: a zero key or mean
    has cosine 0; a chunk without spread has no irregular keys (0). Computed in float64
    (float32 keys are read as they are: widening them first gives the same floats)."""
    x, bounds = _rows(x), np.asarray(bounds, np.int64)
    fused = kernels.irregularity(x, bounds) if x.dtype == np.float32 and x.shape[0] else None
    return fused if fused is not None else _irregularity(x, bounds)


def _rows(x: np.ndarray) -> np.ndarray:
    """``x`` contiguous, float32 kept (the kernels widen each number as they read it),
    anything else as float64."""
    return np.ascontiguousarray(x, np.float32 if x.dtype == np.float32 else np.float64)


@njit(cache=True, nogil=True)
def _irregularity(x, bounds):  # pragma: no cover - compiled
    """One pass per chunk over its rows, in numpy's floats: a chunk's sums add its rows in
    order (numpy's ``sum(axis=0)``), a row's norms and dot products are numpy's pairwise
    sums over its channels (``np.linalg.norm``, ``(x * mu).sum(axis=1)``)."""
    n, d = x.shape
    flat = x.reshape(n * d)
    mu, acc, ones = np.empty(d), np.empty(d), np.ones(d)
    delta = np.zeros(n)
    for i in range(bounds.size - 1):
        lo, hi = bounds[i], bounds[i + 1]
        size = hi - lo
        acc[:] = 0.0  # numpy's sum starts from +0.0 (a column of -0.0 sums to +0.0)
        for t in range(lo, hi):
            acc += x[t]
        mu[:] = acc / size
        for t in range(lo, hi):
            for c in range(d):
                e = x[t, c] - mu[c]
                acc[c] = e * e if t == lo else acc[c] + e * e
        spread = np.sqrt(sum_products(acc, 0, ones, 0, d) / size)  # ||sigma||
        mu_norm = np.sqrt(sum_squares(mu, 0, d))
        for t in range(lo, hi):
            den = np.sqrt(sum_squares(flat, t * d, d)) * mu_norm
            cos = sum_products(flat, t * d, mu, 0, d) / den if den > 0 else 0.0
            delta[t] = (1.0 - cos) / spread if spread > 0 else 0.0
    return delta


@njit(cache=True, nogil=True)
def _regular_prototypes(x, bounds, regular):  # pragma: no cover - compiled
    """float [c, d]: each chunk's regular rows of ``x`` summed in order and scaled to unit
    length (numpy's pairwise norm); chunks whose sum has no length give none. numpy's masked
    sum adds 0.0 for an irregular row, from +0.0: a sum that starts at +0.0 is never -0.0, and
    adding 0.0 leaves any other number as it is, so skipping those rows gives the same floats
    (and lets the row's loop vectorise)."""
    n, d = x.shape
    out = np.empty((bounds.size - 1, d))
    acc = np.empty(d)
    c = 0
    for i in range(bounds.size - 1):
        acc[:] = 0.0
        for t in range(bounds[i], bounds[i + 1]):
            if regular[t]:
                for j in range(d):
                    acc[j] += x[t, j]
        norm = np.sqrt(sum_squares(acc, 0, d))
        if norm > 0:
            out[c] = acc / norm
            c += 1
    return out[:c]


def top_irregular(delta: np.ndarray, p: int) -> np.ndarray:
    """int [min(p, n)], ascending: the ``p`` largest irregularities over all chunks
    together (the paper's text), the earlier cell first on ties; NaN counts as the
    smallest (``np.sort(np.argsort(-delta, kind="stable")[:p])``, tested)."""
    if p <= 0:
        return np.empty(0, np.int64)
    return _top_irregular(np.ascontiguousarray(delta, np.float64), int(p))


@njit(cache=True, nogil=True)
def _top_irregular(delta, p):  # pragma: no cover - compiled
    """One pass with the best ``p`` so far in a sorted buffer: a full sort of 8k
    irregularities per head cost ten times as much."""
    n = delta.shape[0]
    if p >= n:
        return np.arange(n)
    val, ind = np.empty(p), np.empty(p, np.int64)
    k = 0
    for t in range(n):
        v = delta[t]
        if v != v or (k == p and not v > val[p - 1]):  # a tie does not displace an earlier cell
            continue
        j = min(k, p - 1)
        while j > 0 and val[j - 1] < v:
            if j < p:
                val[j], ind[j] = val[j - 1], ind[j - 1]
            j -= 1
        val[j], ind[j] = v, t
        k = min(k + 1, p)
    for t in range(n):  # too few numbers: NaNs follow in order, as a stable sort puts them last
        if k == p:
            break
        if delta[t] != delta[t]:
            ind[k] = t
            k += 1
    return np.sort(ind[:k])


def rff_draw(seed: int, n_bits: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(w0 [n_bits, dim] ~ N(0, 1), b [n_bits] ~ U(0, 2 pi)) from ``seed``: one base draw
    shared by every head, each head scaling w0 by its own gamma (W ~ N(0, gamma^2))."""
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal((n_bits, dim))
    b = rng.uniform(0.0, 2.0 * np.pi, n_bits)
    return w0, b


def rff_gamma(x: np.ndarray) -> float:
    """1 / the median distance between distinct rows of ``x``: the kernel width that
    makes the Fourier phases vary on the scale of the keys' own spacing (too small and
    every key gets one code, too large and the bits are noise). 1 when undefined."""
    m = x.shape[0]
    if m < 2:
        return 1.0
    sq = np.einsum("nd,nd->n", x, x)
    med = _median_distance(sq, x @ x.T)
    return 1.0 / med if med > 0 else 1.0


@njit(cache=True, nogil=True)
def _median_distance(sq, gram):  # pragma: no cover - compiled
    """``np.median(np.sqrt(np.maximum(d2[iu], 0.0)))`` over the pairs i < j of
    ``d2 = sq[:, None] + sq[None, :] - 2.0 * gram``, the same float (NaN if any is): numpy's
    triangle indices and median cost ten times the arithmetic for a head's 24 rows."""
    m = sq.size
    dist = np.empty(m * (m - 1) // 2)
    k = 0
    for i in range(m):
        for j in range(i + 1, m):
            d2 = (sq[i] + sq[j]) - 2.0 * gram[i, j]
            if d2 != d2:
                return np.nan
            dist[k] = np.sqrt(d2 if d2 > 0.0 else 0.0)
            k += 1
    dist.sort()
    h = dist.size // 2
    return dist[h] if dist.size % 2 else (dist[h - 1] + dist[h]) / 2.0


def lsh_buckets(x: np.ndarray, n_bits: int, gamma: float, w0: np.ndarray, b: np.ndarray) -> np.ndarray:
    """int [m] in [0, 2**n_bits): the signs of the random Fourier features
    cos(gamma * w0 @ x + b) read as a binary number, first bit most significant
    (the paper's code [1, 0, 0] is bucket 4). Keys close under a Gaussian kernel
    tend to share their bits, so a bucket gathers similar keys wherever they sit."""
    if w0.shape[0] != n_bits or b.shape != (n_bits,):
        raise ValueError(f"w0 {w0.shape} and b {b.shape} do not hold {n_bits} bits")
    bits = np.cos(gamma * (x @ w0.T) + b) > 0
    return bits.astype(np.int64) @ (np.int64(1) << np.arange(n_bits - 1, -1, -1, dtype=np.int64))


def prototypes(x: np.ndarray, labels: np.ndarray, n_groups: int) -> np.ndarray:
    """float [c, d]: the unit-length sum of the rows of ``x`` in each group
    0..n_groups-1, in group order; empty groups and zero sums give none (c <= n_groups)."""
    if x.shape[0] == 0:
        return np.zeros((0, x.shape[1]))
    order = np.argsort(labels, kind="stable")
    present, starts = np.unique(labels[order], return_index=True)
    sums = np.add.reduceat(x[order], starts, axis=0)
    keep = (present >= 0) & (present < n_groups)
    return unit_rows(sums[keep])


def unit_rows(sums: np.ndarray) -> np.ndarray:
    """The rows of ``sums`` scaled to unit length, rows of zero length left out."""
    norm = np.linalg.norm(sums, axis=1)
    return sums[norm > 0] / norm[norm > 0, None]


# A float32 dot product of d terms, with both factors rounded to float32 first, is within
# (d + 4) * 2**-24 * ||x|| * ||p|| of the exact one (p unit); float64's own is far below.
_F32_SLACK = 2.0**-24
_F64_SLACK = 2.0**-52
_ASSIGN_ROWS = 256  # keys scored against the prototypes at a time


def assign(x: np.ndarray, protos: np.ndarray) -> np.ndarray:
    """int [n]: the prototype of largest cosine to each row of ``x`` (prototypes are unit
    vectors, so the key's own norm does not matter: argmax of the dot product), the
    first on ties; all 0 when there is no prototype.

    This is ProtoKV's largest cost (keys x prototypes, quadratic in the cache). With
    AVX-512 and VNNI the products and the best two run in one compiled pass (``kernels.best_two``),
    most pairs skipped on a screen (``_pruned_best_two``), else as BLAS products and a
    compiled pass over them. The products run in float32
    (float32 keys as they are), at twice float64's speed, and every row whose best two
    float32 scores lie within their rounding bound of each other, or whose best is not
    finite, is decided again in float64. So the answer is float64's
    ``argmax(x @ protos.T)`` (a NaN product wins, the first one, as numpy's argmax has it). The bound holds for any order of the
    float32 sums, so the BLAS may block them as it likes. (Only a key within float64's
    rounding of two prototypes depends on the order its products are summed in, as it
    already did from one BLAS build to another.)"""
    n, c = x.shape[0], protos.shape[0]
    if c <= 1:
        return np.zeros(n, dtype=np.int64)
    p32 = protos.astype(np.float32)
    x32 = np.ascontiguousarray(x, np.float32)
    d = x.shape[1]
    # the bound only filters rows to decide again, so a norm rounded differently (float32
    # keys' in float32: within 1e-5 of float64's, well inside the 1.01) changes nothing
    norms = np.sqrt(np.einsum("nd,nd->n", x, x))
    bound = 2.0 * ((d + 4) * _F32_SLACK + (d + 2) * _F64_SLACK) * 1.01 * norms
    if np.isfinite(p32).all():  # the products and the best two in one compiled pass (AVX-512, VNNI)
        fused = _pruned_best_two(x32, p32, norms) if c >= _PRUNE_MIN_PROTOS else None
        if fused is None:
            fused = kernels.best_two(x32, p32)
        if fused is not None:
            return _settle(x, protos, fused.arg.astype(np.int64), fused.top, fused.second, bound)
    best = np.empty(n, np.int64)
    top = np.empty(_ASSIGN_ROWS, np.float32)
    second = np.empty(_ASSIGN_ROWS, np.float32)
    arg = np.empty(_ASSIGN_ROWS, np.int32)
    for lo in range(0, n, _ASSIGN_ROWS):  # a block of scores stays in cache between the product and its pass
        s = p32 @ x32[lo : lo + _ASSIGN_ROWS].T  # [c, r]: the pass runs along contiguous keys
        r = s.shape[1]
        _best_two(s, top, second, arg)
        best[lo : lo + r] = _settle(x[lo : lo + r], protos, arg[:r].astype(np.int64), top[:r], second[:r],
                                    bound[lo : lo + r])
    return best


_PRUNE_MIN_PROTOS = 64  # fewer prototypes (short caches, tests) take the plain kernel: a cutoff, not a measured break-even
_PRUNE_SAMPLE = 1024  # keys whose second moments give the principal axes
# at most: the screen's channels. AVX-512: 32 in bytes (8 vpdpbusd a key and 16 prototypes;
# 64 FMAs at d = 64 in full). AVX2: 16 in float32 (2 FMAs a key and 8 prototypes, of 8 in full)
_SCREEN_AXES = {"avx512": 32, "avx2": 16}


def _pruned_best_two(x32: np.ndarray, p32: np.ndarray, norms: np.ndarray) -> kernels.BestTwo | None:
    """``kernels.best_two`` with most key-prototype pairs skipped (the same answer), or
    None where the kernel cannot run or the keys are not finite (or so large that their
    squares overflow).

    A head's keys lie close to a few directions. In their principal axes (from the keys'
    second moments) the first channels carry most of each product, and the others can add
    at most ||x's rest|| ||p's rest||. The kernel screens every pair on r = min(32, d / 2)
    such channels in bytes (AVX-512), or min(16, d / 2) in float32 (AVX2), and computes a
    prototype only where that bound reaches the key's best product so far: at 8k cells about
    one 16-prototype half in a hundred (AVX-512) or in twelve (AVX2). The bounds are
    rigorous (``native/kernels.h``)."""
    n, d = x32.shape
    isa = kernels.isa()
    if isa is None or not 8 <= d <= 256 or not np.isfinite(norms).all() or norms.max(initial=0.0) > 1e15:
        return None
    sample = x32[:: max(1, n // _PRUNE_SAMPLE)]
    axes = principal_axes((sample.T @ sample).astype(np.float64), min(_SCREEN_AXES[isa], d // 2 // 4 * 4))
    return None if axes is None else kernels.best_two(x32, p32, axes=axes.astype(np.float32))


def principal_axes(moments: np.ndarray, r: int, steps: int = 3) -> np.ndarray | None:
    """float64 [d, r], orthonormal columns spanning (nearly) the ``r`` largest axes of the
    symmetric ``moments`` [d, d]: a few steps of subspace iteration from the r channels of
    most energy, a fifth of what a full eigendecomposition cost (the screen needs
    orthonormal columns, not exact axes). None when the moments are not finite."""
    if not np.isfinite(moments).all():
        return None
    start = np.argsort(-np.diag(moments), kind="stable")[:r]
    return _subspace_steps(np.ascontiguousarray(moments, np.float64), start, steps)


@njit(cache=True, nogil=True)
def _subspace_steps(m, start, steps):  # pragma: no cover - compiled
    """``steps`` times: q = orthonormal(m @ q), from the unit columns at ``start``.
    Compiled: numpy's QR of a 64 x 16 block cost 60 microseconds a call, mostly its
    overhead."""
    d, r = m.shape[0], start.size
    q = np.zeros((d, r))
    for a in range(r):
        q[start[a], a] = 1.0
    for _ in range(steps):
        p = np.zeros((d, r))
        for i in range(d):
            for k in range(d):
                v = m[i, k]
                for a in range(r):  # along a row of q: independent sums, vectorised
                    p[i, a] += v * q[k, a]
        q = _orthonormal_rows(p.T.copy()).T.copy()
    return q


@njit(cache=True, nogil=True)
def _orthonormal_rows(q):  # pragma: no cover - compiled
    """The rows of ``q`` [r <= d, d] made orthonormal in order, in place (Gram-Schmidt, each
    row projected twice, which leaves it orthogonal to float64's rounding). A row that
    nearly lies in the span of those before it (keys of lower rank than r) is replaced by
    the first unit vector that does not, so the result always has r orthonormal rows."""
    r, d = q.shape
    unit = 0
    for j in range(r):
        size = np.sqrt(_dot(q[j], q[j]))
        for _ in range(d + 1):
            for _ in range(2):
                for i in range(j):
                    dot = _dot(q[i], q[j])
                    for k in range(d):
                        q[j, k] -= dot * q[i, k]
            norm = np.sqrt(_dot(q[j], q[j]))
            if norm > 0 and norm > 1e-10 * size:
                for k in range(d):
                    q[j, k] /= norm
                break
            q[j, :] = 0.0  # in the span of the others: the next unit vector instead
            q[j, unit % d] = 1.0
            unit += 1
            size = 1.0
    return q


@njit(cache=True, nogil=True, inline="always")
def _dot(a, b):  # pragma: no cover - compiled
    """a . b in four interleaved sums: one chain of adds was most of the axes' time."""
    s0 = s1 = s2 = s3 = 0.0
    n = a.size
    k = 0
    while k + 4 <= n:
        s0 += a[k] * b[k]
        s1 += a[k + 1] * b[k + 1]
        s2 += a[k + 2] * b[k + 2]
        s3 += a[k + 3] * b[k + 3]
        k += 4
    while k < n:
        s0 += a[k] * b[k]
        k += 1
    return (s0 + s1) + (s2 + s3)


def _settle(x: np.ndarray, protos: np.ndarray, best: np.ndarray, top: np.ndarray, second: np.ndarray,
            bound: np.ndarray) -> np.ndarray:
    """``best`` with every row float32 cannot decide taken from float64's products: its best
    two within ``bound`` of each other, or its top not finite (a NaN or an infinity in the
    key gives no finite bound, products that overflow no finite top)."""
    with np.errstate(invalid="ignore"):
        unsure = np.flatnonzero(~((top.astype(np.float64) - second > bound) & np.isfinite(top)))
    if unsure.size:
        best[unsure] = np.argmax(float64_products(x[unsure], protos), axis=1)
    return best


def float64_products(x: np.ndarray, protos: np.ndarray) -> np.ndarray:
    """float64 [n, c]: every key's product with every prototype, each summed over the
    channels in one order, whatever the shapes: two equal prototypes tie exactly, so
    argmax takes the first. A BLAS product may sum two columns of one matrix in different
    orders (OpenBLAS's edge columns on AVX2 did), and a few rows in another order than
    all of them; a tie that the paper's argmax breaks to the first would then go either way.
    Only the few rows float32 cannot decide come here (a few dozen of 8k at most)."""
    return np.einsum("nd,cd->nc", x.astype(np.float64), protos.astype(np.float64))


@njit(cache=True, nogil=True)
def _best_two(s, top, second, arg):  # pragma: no cover - compiled
    """Per column i of ``s`` [c, r]: ``top[i]`` the largest entry, ``arg[i]`` its first
    row, ``second[i]`` the largest of the others (``top[i]`` again on a tie). One pass
    over rows, each updating r running maxima side by side, which the compiler
    vectorises; numpy's argmax then max along rows took more than twice as long."""
    c, r = s.shape
    for i in range(r):
        top[i] = s[0, i]
        second[i] = -np.inf
        arg[i] = 0
    for j in range(1, c):
        row = s[j]
        jj = np.int32(j)
        for i in range(r):
            v = row[i]
            a = top[i]
            b = second[i]
            low = v if v < a else a  # a NaN top stays on top; a NaN v is the larger
            second[i] = low if low > b else b
            up = v > a or (v != v and a == a)
            arg[i] = jj if up else arg[i]
            top[i] = v if up else a


def cluster_mean(values: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """float [..., n]: every entry replaced by the mean of ``values`` over its cluster
    (labels [n] >= 0, along the last axis): the paper's pooling, which spreads a vote
    over the keys that look alike instead of over positional neighbours."""
    values = np.asarray(values, np.float64)
    counts = np.bincount(labels)
    flat = values.reshape(-1, values.shape[-1])
    out = np.empty_like(flat)
    for i, row in enumerate(flat):
        sums = np.bincount(labels, weights=row, minlength=counts.size)
        out[i] = (sums / np.maximum(counts, 1))[labels]
    return out.reshape(values.shape)


def lexicographic_rank(primary: np.ndarray, secondary: np.ndarray) -> np.ndarray:
    """float [n]: 0..n-1, the rank of (primary, secondary) in lexicographic order;
    complete ties rank the earlier entry higher, so a stable top-k keeps it first
    (``np.lexsort((-np.arange(n), secondary, primary))``'s ranks, tested)."""
    primary = np.ascontiguousarray(primary, np.float64)
    secondary = np.ascontiguousarray(secondary, np.float64)
    if np.isnan(primary).any() or np.isnan(secondary).any():  # numpy's order of NaNs, as it is
        n = primary.shape[0]
        rank = np.empty(n)
        rank[np.lexsort((-np.arange(n), secondary, primary))] = np.arange(n)
        return rank
    return _lexicographic_rank(primary, secondary)


@njit(cache=True, nogil=True)
def _lexicographic_rank(primary, secondary):  # pragma: no cover - compiled
    """One stable sort by ``primary``, then each run of equal ``primary`` (a cluster: its
    cells share their pooled vote) sorted by ``secondary``, later cells first on ties:
    numpy's three-key lexsort took twice as long."""
    n = primary.shape[0]
    order = np.argsort(primary, kind="mergesort")
    i = 0
    while i < n:
        j = i + 1
        while j < n and primary[order[j]] == primary[order[i]]:
            j += 1
        # later cells first: a stable sort keeps them so on ties
        order[i:j] = _sort_run(order[i:j][::-1].copy(), secondary)
        i = j
    rank = np.empty(n)
    for k in range(n):
        rank[order[k]] = k
    return rank


@njit(cache=True, nogil=True)
def _sort_run(run, key):  # pragma: no cover - compiled
    """The cells ``run`` in ascending ``key``, stably (equal keys keep their order): an
    insertion sort for a cluster's few cells, a merge sort for long runs."""
    if run.size > 32:
        return run[np.argsort(key[run], kind="mergesort")]
    for a in range(1, run.size):
        v = run[a]
        b = a
        while b > 0 and key[run[b - 1]] > key[v]:
            run[b] = run[b - 1]
            b -= 1
        run[b] = v
    return run


def pooled_rank(votes: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """float [n]: ``lexicographic_rank(cluster_mean(votes, labels), votes)`` (tested), the
    rank ProtoKV scores a head's cells by, in one compiled pass: the clusters, not the
    cells, are sorted by their mean vote (a few hundred numbers instead of 8k), and the
    cells are laid out cluster by cluster in linear time."""
    votes = np.ascontiguousarray(votes, np.float64)
    if not np.isfinite(votes).all():  # NaNs in numpy's order (infinities of both signs make a NaN mean)
        return lexicographic_rank(cluster_mean(votes, labels), votes)
    return _pooled_rank(votes, np.ascontiguousarray(labels, np.int64))


@njit(cache=True, nogil=True)
def _pooled_rank(votes, labels):  # pragma: no cover - compiled
    """Each cluster's mean as ``cluster_mean`` has it (the votes added in cell order, over
    the count); the clusters sorted by mean, clusters of equal means run together; the
    cells of a run in order of their own vote, later cells first on ties."""
    n = votes.shape[0]
    c = labels.max() + 1 if n else 0
    sums, counts = np.zeros(c), np.zeros(c, np.int64)
    for t in range(n):
        sums[labels[t]] += votes[t]
        counts[labels[t]] += 1
    means = sums / np.maximum(counts, 1)
    present = np.flatnonzero(counts)
    by_mean = present[np.argsort(means[present], kind="mergesort")]
    run_of = np.empty(c, np.int64)  # clusters of equal means share a run
    runs = 0
    for k in range(by_mean.size):
        if k > 0 and means[by_mean[k]] != means[by_mean[k - 1]]:
            runs += 1
        run_of[by_mean[k]] = runs
    runs += 1
    start = np.zeros(runs + 1, np.int64)
    for t in range(n):
        start[run_of[labels[t]] + 1] += 1
    for r in range(runs):
        start[r + 1] += start[r]
    order = np.empty(n, np.int64)
    fill = start[:-1].copy()
    for t in range(n - 1, -1, -1):  # later cells first within a run
        r = run_of[labels[t]]
        order[fill[r]] = t
        fill[r] += 1
    for r in range(runs):
        order[start[r] : start[r + 1]] = _sort_run(order[start[r] : start[r + 1]], votes)
    rank = np.empty(n)
    for k in range(n):
        rank[order[k]] = k
    return rank


def cluster_ids(x: np.ndarray, chunk: int, n_bits: int, p: int, w0: np.ndarray,
                b: np.ndarray) -> tuple[np.ndarray, int]:
    """(labels [n], number of prototypes) for one head's candidate keys ``x`` [n, d]:
    chunk prototypes of the regular keys first, then bucket prototypes of the ``p``
    most irregular keys, then every key to its nearest prototype. Arithmetic in float64;
    float32 keys are passed as they are, and read so."""
    x = _rows(x)
    n = x.shape[0]
    bounds = chunk_bounds(n, chunk)
    irr = top_irregular(irregularity(x, bounds), p)
    regular = np.ones(n, dtype=bool)
    regular[irr] = False
    reg = _regular_prototypes(x, bounds, regular)
    xi = x[irr].astype(np.float64)
    irr_protos = prototypes(xi, lsh_buckets(xi, n_bits, rff_gamma(xi), w0, b), 1 << n_bits)
    protos = np.concatenate([reg, irr_protos])
    return assign(x, protos), protos.shape[0]


@dataclass
class ProtoKV(ScorerMethod):
    """Rank cells by the mean window vote of their key cluster (chunk + LSH prototypes)."""

    name = "protokv"
    summary = "window attention pooled over clusters of keys from chunk and LSH prototypes (ProtoKV)"
    needs = frozenset({"queries"})
    parallel = True  # host clustering per layer: layers are scored side by side

    sinks: int = 0
    window: int = 32  # the observation window L_obs (the paper does not give it)
    chunk: int = 16  # target chunk length: k = max(1, n // chunk) regular prototypes
    buckets: int = 8  # u = 2**r LSH buckets (r hash bits); a power of two >= 2
    irregular: int = 0  # p, the irregular keys per head; 0: the paper's 3 * buckets
    seed: int = 0  # of the random Fourier features, shared by every head and layer

    def __post_init__(self) -> None:
        super().__post_init__()
        check_window(self.window, 1)
        if self.chunk < 1:
            raise ValueError(f"chunk must be at least 1 (cells per chunk), got {self.chunk}")
        if self.buckets < 2 or self.buckets & (self.buckets - 1):
            raise ValueError(f"buckets must be a power of two >= 2 (2**hash bits), got {self.buckets}")
        if self.irregular < 0:
            raise ValueError(f"irregular must be >= 0 (0: 3 * buckets), got {self.irregular}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    def attach(self, info: ModelInfo) -> None:
        # numba's first call in a process loads the kernels (a tenth of a second or more):
        # at the Session's start, not in the first compression
        x = np.ones((2, 4), np.float32)  # the cache's keys, as score() passes them
        _regular_prototypes(x, np.array([0, 2]), np.ones(2, np.bool_))
        top_irregular(irregularity(x, np.array([0, 2])), 1)
        assign(x, np.eye(2, 4))
        principal_axes(np.eye(4), 4)
        rff_gamma(np.eye(2, 4))
        lexicographic_rank(np.zeros(2), np.zeros(2))
        pooled_rank(np.zeros(2), np.zeros(2, np.int64))

    @property
    def queries_needed(self) -> int:
        return self.window

    @property
    def n_bits(self) -> int:
        return self.buckets.bit_length() - 1

    @property
    def n_irregular(self) -> int:
        return self.irregular or 3 * self.buckets

    def fetch(self, snap: KVSnapshot, layer: int) -> None:
        if snap.n_cells > self.window:
            snap.prefetch_window_attention(self.window)  # every layer in the first call: set up once
            snap.prefetch(layer)

    def score(self, snap: KVSnapshot, layer: int) -> np.ndarray:
        n = snap.n_cells
        m = n - min(self.window, n)  # the candidates: cells before the window
        out = np.full((snap.n_kv_head, n), np.inf)
        if m == 0:
            return out
        # summed over the window's queries and each KV head's query heads: pooling it
        # per KV head is the mean of the group's pooled votes times the group size
        votes = snap.window_attention(layer, self.window)[:, :m]
        keys = snap.keys(layer)
        w0, b = rff_draw(self.seed, self.n_bits, keys.shape[2])
        for g in range(snap.n_kv_head):
            labels, _ = cluster_ids(keys[:m, g], self.chunk, self.n_bits, self.n_irregular, w0, b)
            out[g, :m] = pooled_rank(votes[g], labels)
        return out
