"""ProtoKV against its equations, on synthetic keys and queries.

The clustering steps are checked one by one (irregularity, global top-p,
hashing, prototypes, assignment, cluster-mean pooling) against direct loops and
hand-computed cases, and the method's selection against a loop-by-loop
reference of the whole rule: window votes per query head, chunk statistics,
irregular set, sign LSH of random Fourier features, hybrid prototypes, cosine
assignment, cluster means averaged over each GQA group, top cells by (pooled
vote, raw vote) plus the window.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgekv.errors import BudgetError
from edgekv.kvcache.cells import check_keep
from edgekv.kvcache.queries import QueryWindow
from edgekv.kvcache.snapshot import KVSnapshot
from edgekv.methods.protokv import (
    ProtoKV,
    _regular_prototypes,
    assign,
    chunk_bounds,
    cluster_ids,
    cluster_mean,
    irregularity,
    lexicographic_rank,
    lsh_buckets,
    pooled_rank,
    prototypes,
    rff_draw,
    rff_gamma,
    top_irregular,
)

L, H, G, D = 2, 2, 3, 16  # 2 layers, 2 KV heads, 3 query heads per KV head


def float64_argmax(x: np.ndarray, protos: np.ndarray) -> np.ndarray:
    """The paper's assignment in float64: argmax of the products, the first on ties. Each
    product is summed in one order (einsum's), so equal prototypes tie exactly; a BLAS
    product may sum two columns in different orders and break such a tie either way."""
    return np.argmax(np.einsum("nd,cd->nc", x.astype(np.float64), protos.astype(np.float64)), axis=1)


def structured_keys(n: int, rng: np.random.Generator, block: int = 16, n_out: int = 12,
                    n_anchor: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """[n, D] keys: blocks of ``block`` noisy copies of one direction (regular tokens),
    and ``n_out`` planted outliers scattered over the sequence, each a noisy copy of one
    of ``n_anchor`` shared directions (irregular tokens). Returns (keys, outlier cells)."""
    dirs = rng.standard_normal((-(-n // block), D))
    x = np.repeat(dirs, block, axis=0)[:n] + 0.05 * rng.standard_normal((n, D))
    anchors = rng.standard_normal((n_anchor, D))
    planted = np.sort(rng.choice(n, n_out, replace=False))
    for i, t in enumerate(planted):
        x[t] = anchors[i % n_anchor] + 0.05 * rng.standard_normal(D)
    return x, planted


def snapshot(n: int, n_q: int, seed: int = 0) -> KVSnapshot:
    rng = np.random.default_rng(seed)
    keys, values = [], []
    for _ in range(L):
        k = np.stack([structured_keys(n, rng, n_out=n // 10)[0] for _ in range(H)], axis=1)
        keys.append((2 * k).astype(np.float32))
        values.append(rng.standard_normal((n, H, D)).astype(np.float32))
    q = (rng.standard_normal((L, H * G, n_q, D)) * 1.5).astype(np.float32)
    win = QueryWindow(n_q, tuple(range(L)), q, np.arange(n - n_q, n, dtype=np.int32))
    return KVSnapshot.from_arrays(keys, values, queries=win)


# ---- the clustering steps -------------------------------------------------------


def test_chunk_bounds_split_evenly_with_the_remainder_last() -> None:
    assert chunk_bounds(64, 16).tolist() == [0, 16, 32, 48, 64]
    assert chunk_bounds(35, 16).tolist() == [0, 17, 35]  # k = 2 chunks of 17, remainder 1 to the last
    assert chunk_bounds(70, 16).tolist() == [0, 17, 34, 51, 70]
    assert chunk_bounds(10, 16).tolist() == [0, 10]  # fewer cells than a chunk: one chunk


def test_irregularity_is_the_papers_formula() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((37, 5))
    bounds = chunk_bounds(37, 8)  # 4 chunks: 9, 9, 9, 10
    got = irregularity(x, bounds)
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        mu = x[s:e].mean(axis=0)
        sigma = np.sqrt(((x[s:e] - mu) ** 2).mean(axis=0))
        for t in range(s, e):
            cos = x[t] @ mu / (np.linalg.norm(x[t]) * np.linalg.norm(mu))
            assert got[t] == pytest.approx((1 - cos) / np.linalg.norm(sigma), rel=1e-12)


def ordered_sums(x: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Each chunk's rows added in order (numpy's ``sum(axis=0)``; ``reduceat`` adds in
    another order)."""
    return np.stack([x[s:e].sum(axis=0) for s, e in zip(bounds[:-1], bounds[1:], strict=True)])


def numpy_irregularity(x: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """The irregularity in numpy's own floats: chunk sums row by row, norms and dot
    products as numpy's pairwise sums over the channels."""
    sizes = np.diff(bounds)
    label = np.repeat(np.arange(sizes.size), sizes)
    mu = ordered_sums(x, bounds) / sizes[:, None]
    dev = x - mu[label]
    spread = np.sqrt(ordered_sums(dev * dev, bounds).sum(axis=1) / sizes)
    den = np.linalg.norm(x, axis=1) * np.linalg.norm(mu, axis=1)[label]
    cos = np.divide((x * mu[label]).sum(axis=1), den, out=np.zeros(x.shape[0]), where=den > 0)
    sp = spread[label]
    return np.divide(1.0 - cos, sp, out=np.zeros(x.shape[0]), where=sp > 0)


@pytest.mark.parametrize(("n", "chunk", "d"), [(37, 8, 5), (160, 16, 16), (1000, 16, 64), (700, 7, 200), (9, 16, 128),
                                               (300, 16, 12), (50, 3, 8), (64, 64, 100)])
def test_the_compiled_passes_are_numpys_floats(n: int, chunk: int, d: int) -> None:
    """The irregularity and the regular prototypes come from compiled passes; a float that
    moved in its last bit could move a key in or out of the irregular set, so both must be
    numpy's floats, bit for bit (keys spread over 2^-10 to 2^10, one all-zero chunk). Float32
    keys with 8 <= d <= 128 take the C kernel on an AVX-512 CPU, the others numba's pass."""
    rng = np.random.default_rng(n + d)
    x = rng.standard_normal((n, d)) * np.exp2(rng.uniform(-10, 10, (n, 1)))
    bounds = chunk_bounds(n, chunk)
    x[bounds[0] : bounds[1]] = 0.0
    x[bounds[-2] :, 0] = -0.0  # numpy's sums start from +0.0: a column of -0.0 sums to +0.0
    assert irregularity(x, bounds).tobytes() == numpy_irregularity(x, bounds).tobytes()
    regular = rng.random(n) > 0.2
    sums = ordered_sums(np.where(regular[:, None], x, 0.0), bounds)
    norm = np.linalg.norm(sums, axis=1)
    want = sums[norm > 0] / norm[norm > 0, None]
    assert _regular_prototypes(x, bounds, regular).tobytes() == want.tobytes()
    # float32 keys (the cache's) are read as they are and widened number by number:
    # the same floats as the keys widened first
    x32 = x.astype(np.float32)
    assert irregularity(x32, bounds).tobytes() == numpy_irregularity(x32.astype(np.float64), bounds).tobytes()
    assert _regular_prototypes(x32, bounds, regular).tobytes() == \
        _regular_prototypes(x32.astype(np.float64), bounds, regular).tobytes()


def test_irregularity_guards_zero_norms() -> None:
    x = np.zeros((8, 4))
    x[4:] = 1.0  # second chunk: identical keys, no spread
    delta = irregularity(x, np.array([0, 4, 8]))
    assert np.all(np.isfinite(delta)) and np.all(delta == 0)


def test_planted_outliers_are_the_irregular_set() -> None:
    """(a) Block-structured keys with 12 scattered outliers drawn from 3 shared
    directions: the global top-12 irregularity is exactly the outliers; the regular
    keys join their own chunk's prototype and the outliers join bucket prototypes."""
    for seed in range(5):
        rng = np.random.default_rng(seed)
        x, planted = structured_keys(160, rng)
        delta = irregularity(x, chunk_bounds(160, 16))
        assert top_irregular(delta, 12).tolist() == planted.tolist()
        w0, b = rff_draw(seed, 2, D)
        labels, count = cluster_ids(x, 16, 2, 12, w0, b)
        regular = np.setdiff1d(np.arange(160), planted)
        assert np.array_equal(labels[regular], regular // 16)  # 10 chunk prototypes, in order
        assert np.all(labels[planted] >= 10) and count > 10


def test_top_irregular_is_global_and_breaks_ties_by_position() -> None:
    delta = np.array([0.1, 5.0, 0.3, 5.0, 0.2, 9.0, 0.0, 5.0])
    assert top_irregular(delta, 3).tolist() == [1, 3, 5]  # 5.0 at cells 1, 3, 7: the earlier two
    assert top_irregular(delta, 20).tolist() == list(range(8))


def test_top_irregular_is_the_stable_sorts_choice() -> None:
    # the one-pass selection against the sort it replaces: many ties, signed zeros, NaNs
    rng = np.random.default_rng(11)
    for trial in range(400):
        n = int(rng.integers(1, 300))
        delta = rng.integers(0, 6, n) * (0.5 if trial % 2 else 1.0)
        if trial % 3 == 0:
            delta[rng.integers(0, n, 2)] = -0.0
        if trial % 5 == 0:
            delta[rng.integers(0, n, 3)] = np.nan
        p = int(rng.integers(1, 40))
        want = np.sort(np.argsort(-delta, kind="stable")[:p])
        assert top_irregular(delta, p).tolist() == want.tolist(), (trial, n, p)


def test_lsh_bucket_by_hand() -> None:
    """(b) Bits are cos(gamma W k + b) > 0, first bit most significant."""
    zero = np.zeros((3, 1))
    assert lsh_buckets(np.array([[1.0]]), 3, 1.0, zero, np.array([0.0, np.pi, np.pi])).tolist() == [4]
    x = np.array([[1.0, 2.0]])
    w0 = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # W k = gamma * [1, 2, 3]
    assert lsh_buckets(x, 3, 1.0, w0, np.zeros(3)).tolist() == [4]  # cos 1 > 0 > cos 2, cos 3
    assert lsh_buckets(x, 3, 0.5, w0, np.zeros(3)).tolist() == [7]  # cos .5, cos 1, cos 1.5 > 0
    assert lsh_buckets(x, 3, 1.0, w0, np.full(3, np.pi)).tolist() == [3]  # [0, 1, 1]
    with pytest.raises(ValueError):
        lsh_buckets(x, 2, 1.0, w0, np.zeros(3))


def test_lsh_buckets_are_deterministic_and_in_range() -> None:
    """(b) Same seed, same buckets; every bucket in [0, 2**r)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, D))
    for r in (1, 3, 5):
        w0, b = rff_draw(7, r, D)
        w1, b1 = rff_draw(7, r, D)
        assert np.array_equal(w0, w1) and np.array_equal(b, b1)
        assert np.all((b >= 0) & (b < 2 * np.pi))
        got = lsh_buckets(x, r, rff_gamma(x), w0, b)
        assert np.array_equal(got, lsh_buckets(x, r, rff_gamma(x), w1, b1))
        assert got.min() >= 0 and got.max() < 2**r
        if r >= 3:
            assert np.unique(got).size > 1  # the median-distance gamma spreads the keys
    w2, b2 = rff_draw(8, 3, D)
    assert not np.array_equal(lsh_buckets(x, 3, 0.2, *rff_draw(7, 3, D)), lsh_buckets(x, 3, 0.2, w2, b2))


def test_rff_gamma_is_one_over_the_median_distance() -> None:
    x = np.array([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0]])  # distances 5, 10, 5
    assert rff_gamma(x) == pytest.approx(0.2)
    assert rff_gamma(x[:1]) == 1.0
    assert rff_gamma(np.ones((4, 2))) == 1.0


@pytest.mark.parametrize("m", [2, 3, 24, 25])
def test_rff_gamma_is_numpys_median_float(m: int) -> None:
    rng = np.random.default_rng(m)
    for scale in (1e-3, 1.0, 1e3):
        x = rng.standard_normal((m, 64)) * scale
        sq = np.einsum("nd,nd->n", x, x)
        d2 = sq[:, None] + sq[None, :] - 2.0 * (x @ x.T)
        med = float(np.median(np.sqrt(np.maximum(d2[np.triu_indices(m, 1)], 0.0))))
        assert rff_gamma(x) == 1.0 / med
    x[0, 0] = np.nan  # no median: the default width
    assert rff_gamma(x) == 1.0


def test_prototypes_are_unit_group_sums() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((30, 4))
    labels = rng.permutation(np.arange(30) % 6)
    labels[labels == 3] = 4  # group 3 empty
    x[labels == 5] = 0.0  # group 5 sums to zero
    got = prototypes(x, labels, 6)
    want = [x[labels == g].sum(axis=0) for g in (0, 1, 2, 4)]
    assert np.allclose(got, [w / np.linalg.norm(w) for w in want])
    assert prototypes(np.zeros((0, 4)), np.zeros(0, dtype=np.int64), 3).shape == (0, 4)


def test_assignment_is_the_argmax_cosine() -> None:
    """(c) Against a loop over tokens and prototypes, cosine written out."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((200, D)) * rng.uniform(0.1, 5, (200, 1))
    protos = rng.standard_normal((13, D))
    protos /= np.linalg.norm(protos, axis=1, keepdims=True)
    got = assign(x, protos)
    for t in range(200):
        best, best_cos = -1, -math.inf
        for c in range(13):
            cos = float(x[t] @ protos[c]) / (np.linalg.norm(x[t]) * np.linalg.norm(protos[c]))
            if cos > best_cos:
                best, best_cos = c, cos
        assert got[t] == best
    assert assign(x, np.zeros((0, D))).tolist() == [0] * 200


def test_float32_keys_cluster_as_the_same_keys_in_float64() -> None:
    """ProtoKV hands the cache's float32 keys to the clustering unconverted; every label
    and the prototype count are those of the keys widened to float64 first."""
    rng = np.random.default_rng(21)
    w0, b = rff_draw(0, 3, D)
    for n in (30, 500, 2000):
        x32 = (2 * structured_keys(n, rng, n_out=n // 10)[0]).astype(np.float32)
        got, c = cluster_ids(x32, 16, 3, 24, w0, b)
        want, c64 = cluster_ids(x32.astype(np.float64), 16, 3, 24, w0, b)
        assert c == c64
        assert np.array_equal(got, want)


def test_assignment_follows_numpys_argmax_on_nan() -> None:
    """A NaN product wins, the first one, as numpy's argmax has it: a NaN prototype takes
    every key, a NaN key goes to prototype 0."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((300, D))
    protos = rng.standard_normal((20, D))
    protos /= np.linalg.norm(protos, axis=1, keepdims=True)
    for k in (0, 7, 19):
        bad = protos.copy()
        bad[k, 3] = np.nan
        bad[min(k + 2, 19), 0] = np.nan  # a second NaN prototype: the first still wins
        assert np.array_equal(assign(x, bad), float64_argmax(x, bad))
    y = x.copy()
    y[[0, 150, 299], 5] = np.nan
    assert np.array_equal(assign(y, protos), float64_argmax(y, protos))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_assignment_of_float32_keys_is_float64s_argmax(dtype: type) -> None:
    """Keys as the cache holds them (float32) or widened: float64's argmax over the keys
    widened, near ties included (prototypes apart by far less than float32 resolves)."""
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((3000, D)) * rng.uniform(1e-3, 50, (3000, 1))).astype(np.float32)
    base = rng.standard_normal((40, D))
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    twin = base[:10] + 1e-9 * rng.standard_normal((10, D))
    twin /= np.linalg.norm(twin, axis=1, keepdims=True)
    protos = np.concatenate([base, twin, base[:3]])
    want = float64_argmax(x, protos)
    assert np.array_equal(assign(x.astype(dtype), protos), want)


def test_cluster_mean_pooling() -> None:
    """(d) Against a loop over clusters, for one row and for several."""
    rng = np.random.default_rng(5)
    labels = rng.integers(0, 9, 100)
    values = rng.random((3, 100))
    got = cluster_mean(values, labels)
    for h in range(3):
        for i in range(100):
            members = [j for j in range(100) if labels[j] == labels[i]]
            assert got[h, i] == pytest.approx(sum(values[h, j] for j in members) / len(members))
    assert np.allclose(cluster_mean(values[1], labels), got[1])


def test_lexicographic_rank() -> None:
    primary = np.array([1.0, 2.0, 1.0, 2.0, 1.0])
    secondary = np.array([0.5, 0.1, 0.7, 0.1, 0.5])
    # ascending: (1, .5) cell 4, (1, .5) cell 0, (1, .7) cell 2, (2, .1) cell 3, (2, .1) cell 1
    assert lexicographic_rank(primary, secondary).tolist() == [1, 4, 2, 3, 0]


@pytest.mark.parametrize("seed", range(6))
def test_lexicographic_rank_is_numpys_three_key_lexsort(seed: int) -> None:
    """The compiled rank against the lexsort it replaced: clusters of every size (runs of
    equal primary above and below the insertion sort's 32), tied votes, signed zeros,
    infinities and NaNs (these take numpy's own path)."""
    rng = np.random.default_rng(seed)
    n = 3000
    primary = rng.choice(rng.standard_normal(40 + 60 * seed), n)  # clusters of 1 to hundreds
    primary[rng.random(n) < 0.02] = rng.choice([0.0, -0.0, np.inf, -np.inf], 1)[0]
    secondary = np.round(rng.standard_normal(n), 1)  # many ties within a cluster
    secondary[rng.random(n) < 0.05] = -0.0
    if seed % 3 == 2:
        (primary if seed == 2 else secondary)[rng.integers(0, n, 5)] = np.nan
    want = np.empty(n)
    want[np.lexsort((-np.arange(n), secondary, primary))] = np.arange(n)
    assert np.array_equal(lexicographic_rank(primary, secondary), want)


@pytest.mark.parametrize("seed", range(6))
def test_pooled_rank_is_the_rank_of_the_cluster_means(seed: int) -> None:
    """The one-pass rank ProtoKV scores by, against the two steps it replaces: clusters of
    one to hundreds of cells (runs above and below the insertion sort's 32), clusters whose
    means are equal (their cells run together), tied and signed-zero votes, infinities, and
    NaNs (numpy's own path)."""
    rng = np.random.default_rng(seed)
    n = 3000
    labels = rng.integers(0, 10 + 200 * seed, n)
    votes = np.round(rng.standard_normal(n), 1)
    votes[rng.random(n) < 0.05] = -0.0
    twins = np.flatnonzero(labels == labels[0])
    votes[np.flatnonzero(labels == labels[1])] = votes[twins[0]]  # two clusters of one mean
    votes[twins] = votes[twins[0]]
    if seed == 4:
        votes[twins[:2]] = np.inf, -np.inf  # a cluster whose mean is a NaN
    if seed == 5:
        votes[rng.integers(0, n, 3)] = np.nan
    want = lexicographic_rank(cluster_mean(votes, labels), votes)
    assert np.array_equal(pooled_rank(votes, labels), want)


@pytest.mark.parametrize("n", [1, 5, 23, 64, 161, 500])
def test_prototype_count_and_valid_cluster_ids(n: int) -> None:
    """(f) At most k + u prototypes; every candidate gets one of them."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, D))
    for chunk, r in ((16, 3), (4, 1), (50, 4)):
        w0, b = rff_draw(0, r, D)
        k = max(1, n // chunk)
        labels, count = cluster_ids(x, chunk, r, 3 * 2**r, w0, b)
        assert 1 <= count <= k + 2**r
        assert labels.shape == (n,) and labels.min() >= 0 and labels.max() < count


def test_degenerate_keys_still_cluster() -> None:
    w0, b = rff_draw(0, 3, D)
    for x in (np.zeros((40, D)), np.ones((40, D))):
        labels, count = cluster_ids(x, 16, 3, 24, w0, b)
        assert labels.shape == (40,) and labels.min() >= 0 and labels.max() < max(count, 1)


# ---- the selection against a loop-by-loop reference ---------------------------------


def reference_keep(snap: KVSnapshot, window: int, chunk: int, u: int, seed: int, budget: int) -> np.ndarray:
    """The GQA-aware rule with tie-break, one token, head and prototype at a time:
    int [L, H, budget] (no sinks)."""
    n = snap.n_cells
    m = n - window
    r = round(math.log2(u))
    p = 3 * u
    q, q_pos = snap.queries.last(window)
    out = np.empty((L, H, budget), dtype=np.int64)
    for layer in range(L):
        keys = snap.keys(layer).astype(np.float64)
        # window votes per query head: softmax of each window query, causal, summed
        votes = np.zeros((H * G, m))
        for h in range(H * G):
            for t, pos in enumerate(q_pos):
                logit = np.array([snap.kq_scale * float(keys[j, h // G] @ q[layer, h, t])
                                  for j in range(n) if snap.pos[j] <= pos])
                e = np.exp(logit - logit.max())
                votes[h] += (e / e.sum())[:m]
        for g in range(H):
            x = keys[:m, g]
            k = max(1, m // chunk)
            ell = m // k
            chunks = [(c * ell, (c + 1) * ell if c < k - 1 else m) for c in range(k)]
            delta = np.zeros(m)
            for s, e in chunks:
                mu = x[s:e].mean(axis=0)
                sd = np.linalg.norm(np.sqrt(((x[s:e] - mu) ** 2).mean(axis=0)))
                for t in range(s, e):
                    cos = float(x[t] @ mu) / (np.linalg.norm(x[t]) * np.linalg.norm(mu))
                    delta[t] = (1 - cos) / sd
            irr = sorted(sorted(range(m), key=lambda t: (-delta[t], t))[:p])
            protos = []
            for s, e in chunks:
                tot = sum((x[t] for t in range(s, e) if t not in irr), np.zeros(D))
                if np.linalg.norm(tot) > 0:
                    protos.append(tot / np.linalg.norm(tot))
            dists = [np.linalg.norm(x[i] - x[j]) for a, i in enumerate(irr) for j in irr[a + 1 :]]
            gamma = 1 / float(np.median(dists))
            rng = np.random.default_rng(seed)  # the same draw for every head
            w = rng.normal(0.0, gamma, size=(r, D))
            b = rng.uniform(0.0, 2 * math.pi, size=r)
            bucket = {}
            for j in irr:
                bits = [1 if math.cos(float(w[i] @ x[j]) + b[i]) > 0 else 0 for i in range(r)]
                bucket[j] = sum(bit * 2 ** (r - 1 - i) for i, bit in enumerate(bits)) % u
            for s in range(u):
                members = [j for j in irr if bucket[j] == s]
                if members:
                    tot = sum((x[j] for j in members), np.zeros(D))
                    protos.append(tot / np.linalg.norm(tot))
            cid = []
            for t in range(m):
                cos = [float(x[t] @ c) / (np.linalg.norm(x[t]) * np.linalg.norm(c)) for c in protos]
                cid.append(cos.index(max(cos)))
            heads = [h for h in range(H * G) if h // G == g]
            pooled = np.zeros((len(heads), m))
            for a, h in enumerate(heads):
                for t in range(m):
                    members = [i for i in range(m) if cid[i] == cid[t]]
                    pooled[a, t] = sum(votes[h, i] for i in members) / len(members)
            s_g, c_g = pooled.mean(axis=0), votes[heads].mean(axis=0)
            best = sorted(range(m), key=lambda t: (-s_g[t], -c_g[t], t))[: budget - window]
            out[layer, g] = sorted(best + list(range(m, n)))
    return out


@pytest.mark.parametrize(("chunk", "u", "budget", "seed"),
                         [(16, 4, 40, 0), (16, 8, 70, 1), (10, 2, 100, 2), (24, 4, 56, 3)])
def test_selection_equals_the_reference(chunk: int, u: int, budget: int, seed: int) -> None:
    """(e) The kept cells are the reference's, and the pooling matters: plain
    top-k of the raw votes keeps a different set somewhere."""
    n, w = 160, 16
    snap = snapshot(n, w, seed=seed)
    m = ProtoKV(window=w, chunk=chunk, buckets=u, seed=seed)
    keep = m.select(snap, budget)
    assert np.array_equal(keep, reference_keep(snap, w, chunk, u, seed, budget))
    raw = np.stack([np.sort(np.argsort(-snap.window_attention(layer, w)[:, : n - w], axis=1,
                                       kind="stable")[:, : budget - w], axis=1) for layer in range(L)])
    assert not np.array_equal(keep[:, :, : budget - w], raw)


def test_window_kept_and_selection_contract() -> None:
    n, w = 200, 24
    snap = snapshot(n, w, seed=7)
    m = ProtoKV(window=w, sinks=4)
    assert m.queries_needed == w and m.name == "protokv" and "queries" in m.needs
    for budget in (w + 4, 60, 150, n - 1):
        keep = m.select(snap, budget)
        assert keep.shape == (L, H, budget)
        check_keep(keep, L, H, n)
        assert np.all(np.diff(keep, axis=2) > 0)
        for layer in range(L):
            for g in range(H):
                assert set(range(n - w, n)) | set(range(4)) <= set(keep[layer, g].tolist())
        assert np.array_equal(keep, m.select(snapshot(n, w, seed=7), budget))
    assert np.array_equal(m.select(snap, n), np.broadcast_to(np.arange(n), (L, H, n)))
    with pytest.raises(BudgetError, match="always keeps"):
        m.select(snap, w + 3)
    s = m.score(snap, 0)
    assert s.shape == (H, n) and np.all(np.isinf(s[:, n - w :]))
    assert np.all(np.isfinite(s[:, : n - w]))
    assert np.array_equal(np.sort(s[0, : n - w]), np.arange(n - w))  # a rank, no ties


def test_one_draw_shared_by_every_head() -> None:
    """Two heads with the same keys and queries cluster and select the same cells."""
    n, w = 120, 16
    rng = np.random.default_rng(11)
    k0 = structured_keys(n, rng)[0].astype(np.float32)
    keys = [np.stack([k0, k0], axis=1)] * L
    q1 = rng.standard_normal((L, G, w, D)).astype(np.float32)
    q = np.concatenate([q1, q1], axis=1)
    win = QueryWindow(w, tuple(range(L)), q, np.arange(n - w, n, dtype=np.int32))
    snap = KVSnapshot.from_arrays(keys, keys, queries=win)
    keep = ProtoKV(window=w, chunk=8, buckets=16).select(snap, 50)
    assert np.array_equal(keep[:, 0], keep[:, 1])


def test_short_caches() -> None:
    """Fewer candidates than irregular keys, or none at all, still select."""
    snap = snapshot(30, 16, seed=1)
    keep = ProtoKV(window=16, buckets=8).select(snap, 20)  # 14 candidates < p = 24
    check_keep(keep, L, H, 30)
    keep = ProtoKV(window=32).select(snapshot(40, 16, seed=1), 36)
    assert np.all(keep[:, :, -32:] == np.arange(8, 40))


@pytest.mark.parametrize("params", [
    {"window": 0}, {"chunk": 0}, {"buckets": 1}, {"buckets": 6}, {"buckets": 0},
    {"irregular": -1}, {"sinks": -1}, {"seed": -1},
])
def test_bad_parameters(params: dict[str, int]) -> None:
    """(g)"""
    with pytest.raises(ValueError):
        ProtoKV(**params)


def test_defaults() -> None:
    m = ProtoKV()
    assert (m.sinks, m.window, m.chunk, m.buckets, m.irregular, m.seed) == (0, 32, 16, 8, 0, 0)
    assert m.n_bits == 3 and m.n_irregular == 24
    assert ProtoKV(irregular=5).n_irregular == 5


def test_assignment_is_float64s_argmax_even_on_near_ties() -> None:
    """The float32 products hand every row they cannot decide to float64: prototypes
    that are equal, or apart by far less than float32 resolves, give float64's argmax
    (first on exact ties), row for row, as do keys of every scale."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3000, D)) * rng.uniform(1e-3, 50, (3000, 1))
    base = rng.standard_normal((40, D))
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    twin = base[:10] + 1e-9 * rng.standard_normal((10, D))
    twin /= np.linalg.norm(twin, axis=1, keepdims=True)
    for protos in (base, np.concatenate([base, base[:5]]), np.concatenate([base, twin]),
                   np.concatenate([twin, base])):
        want = float64_argmax(x, protos)
        assert np.array_equal(assign(x, protos), want)
    # keys built on a prototype's bisector tie in exact arithmetic
    mid = (base[0] + base[1]) / 2
    on_edge = mid[None, :] * rng.uniform(0.5, 2, (50, 1))
    assert np.array_equal(assign(on_edge, base), float64_argmax(on_edge, base))


def avx512_kernels() -> bool:
    """Whether edgekv's host kernels run their AVX-512 bodies here: an AVX-512 CPU with
    VNNI, not told to act as an AVX2 one."""
    import os

    from edgekv.llama import cpu_flag

    return cpu_flag("avx512f") and cpu_flag("avx512_vnni") and os.environ.get("EDGEKV_CPU", "") != "avx2"


def kernel_isa(avx2_only: bool = False) -> str | None:
    """The kernels' instruction set this CPU should get, from /proc/cpuinfo (``avx2_only``:
    under EDGEKV_CPU=avx2)."""
    from edgekv.llama import cpu_flag

    if avx512_kernels() and not avx2_only:
        return "avx512"
    return "avx2" if cpu_flag("avx2") and cpu_flag("fma") else None


def test_the_kernels_run_where_the_cpu_has_them(monkeypatch) -> None:
    """The kernels run on AVX-512 with VNNI, else on AVX2 with FMA (an AVX-512 CPU under
    EDGEKV_CPU=avx2 too), and decline elsewhere, where ProtoKV keeps numpy's BLAS and
    numba's pass. On AVX2 the unscreened ``best_two`` declines (numpy's BLAS is as fast);
    the screened one and ``irregularity`` run."""
    from edgekv import kernels

    x = np.ones((3, 8), np.float32)
    p = np.eye(2, 8, dtype=np.float32)
    axes = np.eye(8, 4, dtype=np.float32)
    bounds = np.array([0, 3])
    for isa in (kernel_isa(), kernel_isa(avx2_only=True)):
        assert kernels.isa() == isa
        assert (kernels.best_two(x, p) is not None) == (isa == "avx512")
        screened = kernels.best_two(x, p, axes=axes)
        assert (screened is not None) == (isa is not None)
        if screened is not None:  # x . p: 1 for both prototypes, a tie: the first
            assert screened.arg.tolist() == [0, 0, 0] and screened.top.tolist() == screened.second.tolist() == [1] * 3
        assert (kernels.irregularity(x, bounds) is not None) == (isa is not None)
        assert kernels.irregularity(np.ones((3, 4), np.float32), bounds) is None  # numpy sums d < 8 otherwise
        assert kernels.irregularity(np.ones((3, 136), np.float32), bounds) is None  # and d > 128 in two blocks
        monkeypatch.setenv("EDGEKV_CPU", "avx2")  # the second round: as an AVX2-only CPU


@pytest.mark.parametrize(("n", "c", "d"), [(1, 2, 64), (13, 31, 64), (500, 32, 64), (2049, 517, 64),
                                           (300, 33, 128), (77, 100, 48), (29, 40, 20), (40, 5, 3)])
def test_the_fused_kernels_best_two_are_the_float32_products(n: int, c: int, d: int) -> None:
    """Top, second and the first best prototype per key: within float32's rounding of the
    float64 products, with every padded column of the kernel's last tile left out (c not a
    multiple of 32, tiles of 12 keys cut short, channels past the last eight), and the
    earlier of two equal prototypes."""
    from edgekv import kernels

    if not avx512_kernels():
        pytest.skip("no AVX-512 with VNNI: the unscreened kernel declines for numpy's BLAS, tested above")
    rng = np.random.default_rng(n + c + d)
    x = (rng.standard_normal((n, d)) * rng.uniform(0.1, 30, (n, 1))).astype(np.float32)
    protos = rng.standard_normal((c, d))
    protos /= np.linalg.norm(protos, axis=1, keepdims=True)
    protos[c // 2] = protos[0]  # an exact tie with prototype 0 (c = 2: the only other one)
    p32 = protos.astype(np.float32)
    got = kernels.best_two(x, p32)
    top, second, arg = got.top, got.second, got.arg
    s = x.astype(np.float64) @ p32.astype(np.float64).T
    slack = 2 * (d + 4) * 2.0**-24 * np.linalg.norm(x.astype(np.float64), axis=1)
    srt = np.sort(s, axis=1)
    assert np.all(np.abs(top - srt[:, -1]) <= slack)
    assert np.all(np.abs(second - srt[:, -2]) <= slack)
    assert np.all(s[np.arange(n), arg] >= srt[:, -1] - 2 * slack)  # a best one, up to rounding
    assert np.all((arg >= 0) & (arg < c))
    tied = np.flatnonzero(s.argmax(axis=1) == 0)  # prototype 0 best: its twin at c // 2 ties it
    assert np.all(arg[tied] == 0) and np.all(second[tied] == top[tied])


def test_assignment_is_the_same_with_and_without_the_fused_kernel(monkeypatch) -> None:
    """ProtoKV's clusters on this CPU's kernels, under EDGEKV_CPU=avx2 (the AVX2 kernels)
    and with no kernels (numpy's BLAS and numba's pass): the same labels for cache-like
    keys, for rows with a NaN or an infinity, and for keys whose float32 products overflow
    (numpy decides those in float64)."""
    from edgekv import kernels

    rng = np.random.default_rng(31)
    w0, b = rff_draw(0, 3, 64)
    x = (3 * rng.standard_normal((64, 1, 64)) + rng.standard_normal((64, 32, 64))).reshape(2048, 64)
    x = x.astype(np.float32)
    fused, _ = cluster_ids(x, 16, 3, 24, w0, b)
    protos = rng.standard_normal((45, 64))
    protos /= np.linalg.norm(protos, axis=1, keepdims=True)
    y = x[:400].copy()
    y[5, 3], y[77, 0], y[78, 9] = np.nan, np.inf, -np.inf
    y[200] = 3e38  # finite, but its float32 products overflow
    odd = assign(y, protos)
    monkeypatch.setenv("EDGEKV_CPU", "avx2")
    assert np.array_equal(cluster_ids(x, 16, 3, 24, w0, b)[0], fused)
    assert np.array_equal(assign(y, protos), odd)
    monkeypatch.setattr(kernels, "_runnable", lambda: None)
    assert kernels.isa() is None
    assert np.array_equal(cluster_ids(x, 16, 3, 24, w0, b)[0], fused)
    assert np.array_equal(assign(y, protos), odd)
    with np.errstate(invalid="ignore", over="ignore"):
        assert np.array_equal(odd, float64_argmax(y, protos))


def cache_like_keys(n: int, d: int, rank: int, rng: np.random.Generator, noise: float = 0.05) -> np.ndarray:
    """float32 [n, d]: keys as a model's heads make them, close to ``rank`` directions
    (``noise`` off them), in runs of 16 that share a direction, at varied norms."""
    basis = rng.standard_normal((rank, d)) * np.geomspace(8, 1, rank)[:, None]
    runs = np.repeat(rng.standard_normal((-(-n // 16), rank)), 16, axis=0)[:n]
    x = (runs + 0.3 * rng.standard_normal((n, rank))) @ basis + noise * rng.standard_normal((n, d))
    return (x * rng.uniform(0.5, 3, (n, 1))).astype(np.float32)


def chunk_prototypes(x: np.ndarray, extra: np.ndarray) -> np.ndarray:
    """ProtoKV's kind of prototypes for ``x``: unit sums of its chunks of 16, then ``extra``."""
    sums = np.add.reduceat(x.astype(np.float64), np.arange(0, x.shape[0], 16), axis=0)
    protos = np.concatenate([sums, extra])
    return protos / np.linalg.norm(protos, axis=1, keepdims=True)


def test_principal_axes_are_orthonormal_and_span_the_largest_axes() -> None:
    from edgekv.methods.protokv import principal_axes

    rng = np.random.default_rng(3)
    q, _ = np.linalg.qr(rng.standard_normal((64, 64)))
    moments = (q * np.concatenate([np.geomspace(1e4, 1e2, 16), np.geomspace(1, 1e-2, 48)])) @ q.T
    axes = principal_axes(moments, 16)
    assert axes.shape == (64, 16)
    assert np.abs(axes.T @ axes - np.eye(16)).max() < 1e-13
    # the span of the 16 largest axes (a hundredfold gap to the others): nothing is left out
    top = q[:, :16]
    assert np.linalg.norm(top - axes @ (axes.T @ top)) < 1e-3
    assert principal_axes(np.full((8, 8), np.nan), 2) is None
    # keys of lower rank than r (and none at all): still r orthonormal columns
    for low in (np.diag(np.r_[np.ones(3), np.zeros(61)]), np.ones((64, 64)), np.zeros((64, 64))):
        axes = principal_axes(low, 16)
        assert np.abs(axes.T @ axes - np.eye(16)).max() < 1e-13


@pytest.mark.parametrize(("n", "d", "rank", "noise"), [(4100, 64, 6, 0.05), (2000, 64, 12, 0.3),
                                                        (1500, 128, 10, 0.05), (1200, 64, 64, 1.0),
                                                        (999, 32, 3, 0.0)])
def test_the_screened_assignment_is_float64s_argmax(n: int, d: int, rank: int, noise: float) -> None:
    """With AVX-512, keys against many prototypes skip most pairs on a screen in their
    principal axes; the clusters stay float64's argmax, row for row: cache-like keys of few
    or many directions (isotropic ones, where few pairs can be skipped), exact ties between
    twin prototypes, and prototypes that differ only outside the keys' span, which the
    screen cannot tell apart (their products tie in exact arithmetic)."""
    rng = np.random.default_rng(n + d + rank)
    x = cache_like_keys(n, d, rank, rng, noise)
    extra = rng.standard_normal((8, d))
    protos = chunk_prototypes(x, extra)
    protos[len(protos) // 3] = protos[len(protos) // 3 + 1]  # twins: an exact tie
    if noise == 0.0:  # keys in a span of 3 directions: tilt two prototypes off it alike
        span, _ = np.linalg.qr(x[:64].astype(np.float64).T)
        off = rng.standard_normal(d)
        off -= span[:, :rank] @ (span[:, :rank].T @ off)
        for j in (5, 40):
            protos[j] = protos[5] + 0.5 * (1 if j == 5 else -1) * off / np.linalg.norm(off)
        protos /= np.linalg.norm(protos, axis=1, keepdims=True)
    want = float64_argmax(x, protos)
    assert np.array_equal(assign(x, protos), want)


def test_prototypes_closer_than_a_bytes_step_are_told_apart() -> None:
    """Prototypes that differ by far less than the screen's byte step (in the keys' main
    axis, where the bytes are coarsest) all pass the screen, and float64 decides between
    them: the labels are its argmax, key for key."""
    rng = np.random.default_rng(12)
    x = cache_like_keys(4100, 64, 6, rng)
    protos = chunk_prototypes(x, rng.standard_normal((8, 64)))
    main = np.linalg.svd(x[::4].astype(np.float64), full_matrices=False)[2][0]
    for j in range(0, len(protos) - 1, 7):  # near twins: a nudge along the main axis
        protos[j + 1] = protos[j] + 1e-5 * (1 if j % 2 else -1) * main
    protos /= np.linalg.norm(protos, axis=1, keepdims=True)
    want = float64_argmax(x, protos)
    assert np.array_equal(assign(x, protos), want)


@pytest.mark.parametrize(("n", "c", "d", "r"), [(1000, 100, 20, 8), (700, 70, 64, 32), (999, 200, 48, 12),
                                                (13, 33, 16, 4), (300, 64, 256, 20), (500, 64, 33, 8)])
@pytest.mark.parametrize("cpu", ["native", "avx2"])
def test_the_screened_kernel_finds_the_best_prototype(n: int, c: int, d: int, r: int, cpu: str,
                                                       monkeypatch) -> None:
    """``best_two`` with a screen of r axes, on either body: for every key whose best
    product beats the others by more than float32's rounding, that prototype and its product,
    at head sizes and screen widths ProtoKV does not pick (channels past the last eight, an
    odd count, r past 16, short tiles), over keys whose axes carry most but not all of their length."""
    from edgekv import kernels
    from edgekv.methods.protokv import principal_axes

    if cpu == "avx2":
        monkeypatch.setenv("EDGEKV_CPU", "avx2")
    if kernels.isa() is None or (cpu == "avx2" and kernels.isa() != "avx2"):
        pytest.skip("no AVX2 with FMA: no screened kernel")
    rng = np.random.default_rng(n + c + d + r)
    x = cache_like_keys(n, d, min(d, 6), rng)
    chunks = -(-n // 16)  # the chunk prototypes, then random ones up to c (at least 8)
    p32 = chunk_prototypes(x, rng.standard_normal((max(8, c - chunks), d)))[:c].astype(np.float32)
    assert p32.shape[0] == c
    axes = principal_axes(x.astype(np.float64).T @ x, r).astype(np.float32)
    got = kernels.best_two(x, p32, axes=axes)
    s = np.sort(x.astype(np.float64) @ p32.astype(np.float64).T, axis=1)
    slack = 2 * (d + 6) * 2.0**-24 * np.linalg.norm(x.astype(np.float64), axis=1)
    sure = s[:, -1] - s[:, -2] > 2 * slack
    assert sure.mean() > 0.9
    assert np.array_equal(got.arg[sure], float64_argmax(x[sure], p32))
    assert np.all(np.abs(got.top - s[:, -1]) <= slack)
    assert np.all(got.second <= got.top)  # a bound on the prototypes that could be best, not the true second


@pytest.mark.parametrize("cpu", ["native", "avx2"])
def test_the_screen_keeps_the_kernels_answer(cpu: str, monkeypatch) -> None:
    """The screened kernel (bytes on AVX-512, float32 on AVX2) skips most of the work and
    gives the best prototype and product of all of them for every key that can be decided,
    on keys from a real model's shape (8k cells, 517 prototypes)."""
    from edgekv import kernels
    from edgekv.methods import protokv

    if cpu == "avx2":
        monkeypatch.setenv("EDGEKV_CPU", "avx2")
    if kernels.isa() is None or (cpu == "avx2" and kernels.isa() != "avx2"):
        pytest.skip("no AVX2 with FMA: ProtoKV's assignment runs numpy's BLAS, tested above")
    rng = np.random.default_rng(8)
    x = cache_like_keys(8160, 64, 8, rng)
    p32 = chunk_prototypes(x, rng.standard_normal((8, 64))).astype(np.float32)
    norms = np.sqrt(np.einsum("nd,nd->n", x, x))
    got = protokv._pruned_best_two(x, p32, norms)
    assert got.screened > 8160 * 2 * 10 and got.passed < 0.2 * got.screened
    s = np.sort(x.astype(np.float64) @ p32.astype(np.float64).T, axis=1)
    slack = 2 * 70 * 2.0**-24 * norms
    sure = s[:, -1] - s[:, -2] > 2 * slack  # the best by more than the float32 products' rounding
    assert sure.mean() > 0.99
    assert np.array_equal(got.arg[sure], float64_argmax(x[sure], p32))
    assert np.all(np.abs(got.top - s[:, -1]) <= slack)
