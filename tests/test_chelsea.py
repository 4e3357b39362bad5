"""Chelsea's Chunked Soft Matching and count-weighted merging against the paper's
equations, on synthetic keys and values.

``ArrayEngine`` is a cache of float arrays that implements the two verbs
Chelsea drives (``snapshot`` and ``merge``) with the merge rule written out
directly, and remembers which original tokens every cell absorbed; the real
engines are held to the same rule in tests/test_merge.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgekv.config import BudgetRule
from edgekv.errors import BudgetError, EdgekvError
from edgekv.kvcache.cells import check_merge, merge_groups
from edgekv.kvcache.queries import window_attention
from edgekv.kvcache.snapshot import KVSnapshot
from edgekv.methods import get_method
from edgekv.methods.chelsea import _unit_rows_into, edges, match

L, H, D = 2, 3, 8


class ArrayEngine:
    """A cache of float64 K/V [n, H, d] per layer; merge = count-weighted means, sources dropped."""

    name = "arrays"
    capabilities = frozenset({"merge", "bias"})

    def __init__(self, keys: list[np.ndarray], values: list[np.ndarray]) -> None:
        n = keys[0].shape[0]
        self.k = [np.array(k, np.float64) for k in keys]
        self.v = [np.array(v, np.float64) for v in values]
        self.counts = np.ones((L, H, n))
        self.token_pos = np.broadcast_to(np.arange(n, dtype=np.int32), (L, H, n)).copy()
        self.absorbed = [[[{i} for i in range(n)] for _ in range(H)] for _ in range(L)]
        self.merges: list[tuple[np.ndarray, np.ndarray]] = []

    @property
    def n_cells(self) -> int:
        return self.counts.shape[2]

    def snapshot(self) -> KVSnapshot:
        return KVSnapshot.from_arrays([k.astype(np.float32) for k in self.k], [v.astype(np.float32) for v in self.v],
                                      self.token_pos, counts=self.counts)

    def merge(self, src: np.ndarray, dst: np.ndarray, *, bias: bool) -> None:
        src, dst = check_merge(src, dst, L, H, self.n_cells)
        self.merges.append((src, dst))
        n, m = self.n_cells, src.shape[2]
        keep = np.empty((L, H, n - m), np.int64)
        for li in range(L):
            for h in range(H):
                c = self.counts[li, h]
                k, v = self.k[li][:, h] * c[:, None], self.v[li][:, h] * c[:, None]
                c = c.copy()
                for s, d in zip(src[li, h], dst[li, h], strict=True):
                    k[d] += k[s]
                    v[d] += v[s]
                    c[d] += c[s]
                    self.absorbed[li][h][d] |= self.absorbed[li][h][s]
                self.k[li][:, h], self.v[li][:, h] = k / c[:, None], v / c[:, None]
                self.counts[li, h] = c
                keep[li, h] = np.setdiff1d(np.arange(n), src[li, h])
                self.absorbed[li][h] = [self.absorbed[li][h][i] for i in keep[li, h]]
        # per-head gather, as the engines compact
        self.k = [np.stack([k[keep[li, h], h] for h in range(H)], axis=1) for li, k in enumerate(self.k)]
        self.v = [np.stack([v[keep[li, h], h] for h in range(H)], axis=1) for li, v in enumerate(self.v)]
        self.counts = np.take_along_axis(self.counts, keep, axis=2)
        self.token_pos = np.take_along_axis(self.token_pos, keep, axis=2)


def cache(n: int, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Keys that drift slowly along the sequence (neighbours similar, as after RoPE)."""
    rng = np.random.default_rng(seed)
    keys = [np.cumsum(rng.standard_normal((n, H, D)), axis=0) + 5 * rng.standard_normal((1, H, D)) for _ in range(L)]
    values = [rng.standard_normal((n, H, D)) for _ in range(L)]
    return keys, values


def test_edges_pair_sources_with_their_best_destination_inside_the_chunk() -> None:
    e = np.eye(4)
    # chunk 0: sources are cells 0 and 2, destinations 1 and 3
    keys = np.array([e[0], e[1], e[1] + 0.1 * e[2], e[0] + 0.2 * e[3],
                     # chunk 1 holds a copy of cell 0, which must not reach across
                     e[0], e[2], e[3]])
    a, b, score = edges(keys, chunk=4)
    assert a.tolist() == [0, 2, 4, 6]
    assert b.tolist() == [3, 1, 5, 5]  # cell 6 (a source alone with one destination) still points there
    unit = keys / np.linalg.norm(keys, axis=1, keepdims=True)
    np.testing.assert_allclose(score, [unit[0] @ unit[3], unit[2] @ unit[1], unit[4] @ unit[5], unit[6] @ unit[5]])
    # a source alone in the last chunk has no edge
    a, b, _ = edges(keys[:5], chunk=4)
    assert a.tolist() == [0, 2]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d", [6, 64, 200])
def test_unit_keys_are_numpys_floats(dtype, d: int) -> None:
    # the matching's cosines start from the compiled normalisation: its unit keys must be
    # numpy's to the bit (float32 norms summed in float32), or an edge's score moves and the
    # m best edges with it; zero rows meet the 1e-12 floor, and the padding is zeros
    rng = np.random.default_rng(d)
    keys = (rng.standard_normal((3, 301, d)) * np.exp2(rng.uniform(-8, 8, (3, 301, 1)))).astype(dtype)
    keys[1, 7] = 0.0
    want = np.divide(keys, np.maximum(np.linalg.norm(keys, axis=-1, keepdims=True), 1e-12))
    out = np.full((3, 320, d), np.nan, dtype)
    _unit_rows_into(keys, out, dtype(1e-12))
    assert out[:, :301].tobytes() == want.tobytes() and not out[:, 301:].any()


def test_edges_equal_a_direct_loop() -> None:
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((203, 6))
    a, b, score = edges(keys, chunk=16)
    want = []
    for start in range(0, 203, 16):
        cells = list(range(start, min(start + 16, 203)))
        for s in cells[0::2]:
            dsts = cells[1::2]
            if not dsts:
                continue
            cos = [keys[s] @ keys[d] / np.linalg.norm(keys[s]) / np.linalg.norm(keys[d]) for d in dsts]
            want.append((s, dsts[int(np.argmax(cos))], max(cos)))
    assert a.tolist() == [w[0] for w in want]
    assert b.tolist() == [w[1] for w in want]
    np.testing.assert_allclose(score, [w[2] for w in want], rtol=1e-6)


def test_match_ranks_edges_across_all_chunks_not_per_chunk() -> None:
    n = 64
    rng = np.random.default_rng(1)
    k = rng.standard_normal((n, H, D))
    k[17] = k[16] * 2  # chunk 1 (cells 16..31 with chunk=16): two near-identical pairs
    k[21] = k[18] + 1e-3
    snap = KVSnapshot.from_arrays([k, k], [k, k])
    src, dst = match(snap, np.broadcast_to(np.arange(n), (L, H, n)), chunk=16, m=2)
    assert sorted(zip(src[0, 0].tolist(), dst[0, 0].tolist(), strict=True)) == [(16, 17), (18, 21)]
    assert match(snap, np.broadcast_to(np.arange(n), (L, H, n)), chunk=16, m=33) == (None, None)


def test_rate_schedule_and_landing_on_the_target() -> None:
    m = get_method("chelsea", sinks=4, window=8, chunk=16)
    assert [round(m.rate(i), 6) for i in range(5)] == [0.35, 0.25, 0.15, 0.15, 0.15]
    assert get_method("chelsea", r_init=0.2, r_decay=0.1).rate(4) == 0.05  # the floor
    eng = ArrayEngine(*cache(300))
    m.compress(eng, 100)
    assert eng.n_cells == 100
    # middle 288: 0.35 x 288 = 100, 0.25 x 188 = 47, 0.15 x 141 = 21, then 0.15 x 120 = 18, and the
    # last step is cut to land on the target
    assert [s.shape[2] for s, _ in eng.merges] == [100, 47, 21, 18, 14]


def test_merges_keep_protected_cells_order_and_count_weighted_means() -> None:
    keys, values = cache(400, seed=2)
    eng = ArrayEngine(keys, values)
    m = get_method("chelsea", sinks=16, window=64, chunk=32)
    m.compress(eng, 250)
    m.compress(eng, 150)  # a second compression merges centroids again
    assert eng.n_cells == 150
    for li in range(L):
        for h in range(H):
            tp = eng.token_pos[li, h]
            assert np.all(np.diff(tp) > 0)  # survivors keep their order
            assert np.array_equal(tp[:16], np.arange(16)) and np.array_equal(tp[-64:], np.arange(336, 400))
            # counts add up to every token, and each cell is the plain mean of the tokens it absorbed
            assert eng.counts[li, h].sum() == 400
            for j, toks in enumerate(eng.absorbed[li][h]):
                assert len(toks) == eng.counts[li, h, j] and tp[j] in toks  # the destination's token
                idx = sorted(toks)
                np.testing.assert_allclose(eng.k[li][j, h], keys[li][idx, h].mean(axis=0), atol=1e-9)
                np.testing.assert_allclose(eng.v[li][j, h], values[li][idx, h].mean(axis=0), atol=1e-9)
    # merges never cross a chunk: a destination and its source sit in one chunk of the middle
    src, dst = eng.merges[0]
    assert np.all(np.abs(src - dst) < 32) and np.all((src - 16) // 32 == (dst - 16) // 32)


def test_log_count_bias_makes_merged_duplicates_exact() -> None:
    """Eq. (2): attention over a centroid with log(count) added equals attention over
    its members when they share the key, whatever their values."""
    rng = np.random.default_rng(5)
    n = 40
    k = rng.standard_normal((n, 1, D))
    k[11:15] = k[10]  # five tokens with one key
    v = rng.standard_normal((n, 1, D))
    q = rng.standard_normal((1, 4, D)).astype(np.float32)
    pos = np.arange(n, dtype=np.int32)
    q_pos = np.full(4, n, np.int32)

    def out(keys: np.ndarray, vals: np.ndarray, p: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        logit = (q[0] @ keys[:, 0].T) / np.sqrt(D) + (0 if bias is None else bias[0])
        w = np.exp(logit - logit.max(axis=1, keepdims=True))
        return (w / w.sum(axis=1, keepdims=True)) @ vals[:, 0]

    keep = np.r_[0:11, 15:n]
    vm = v[keep].copy()
    vm[10] = v[10:15].mean(axis=0)
    counts = np.ones((1, keep.size))
    counts[0, 10] = 5
    want = out(k, v, pos, None)
    np.testing.assert_allclose(out(k[keep], vm, pos[keep], np.log(counts)), want, atol=1e-12)
    assert np.abs(out(k[keep], vm, pos[keep], None) - want).max() > 1e-3  # without the bias it is not
    # the observation-window attention the engines use adds the same bias
    a = window_attention(q, q_pos, k[keep].astype(np.float32), pos[keep], 1 / np.sqrt(D), np.log(counts))
    full = window_attention(q, q_pos, k.astype(np.float32), pos, 1 / np.sqrt(D))
    np.testing.assert_allclose(a[0, 10], full[0, 10:15].sum(), rtol=1e-5)


def test_merge_groups_bins_stars_by_size() -> None:
    src = np.array([[[5, 1, 7, 9, 3]]])  # one (layer, head)
    dst = np.array([[[4, 2, 4, 4, 2]]])
    groups = merge_groups(src, dst)
    assert [g[0, 0].tolist() for g in groups] == [[[2, 1, 3, -1], [4, 5, 7, 9]]]  # sizes 3 and 4: width 4
    groups = merge_groups(np.array([[[1, 8, 5, 7, 9, 11]]]), np.array([[[2, 6, 4, 4, 4, 4]]]))
    assert [g[0, 0].tolist() for g in groups] == [[[2, 1], [6, 8]], [[4, 5, 7, 9, 11, -1, -1, -1]]]


def test_merge_groups_hold_every_star_once_whatever_the_mix_of_sizes() -> None:
    """Random merges: each group row is its destination then its sources in ascending
    order, in the bin of the next power of two, groups in destination order per bin."""
    rng = np.random.default_rng(3)
    for _ in range(100):
        n = int(rng.integers(4, 600))
        cells = rng.permutation(n)
        n_dst = int(rng.integers(1, n // 2 + 1))
        dsts, srcs = cells[:n_dst], cells[n_dst:][: int(rng.integers(1, n - n_dst + 1))]
        dst = dsts[rng.integers(0, n_dst, srcs.size) % np.maximum(1, rng.integers(1, n_dst + 1))]
        want: dict[int, list[list[int]]] = {}
        for d in np.unique(dst):
            row = [int(d), *sorted(int(x) for x in srcs[dst == d])]
            w = 1 << (len(row) - 1).bit_length()
            want.setdefault(w, []).append(row + [-1] * (w - len(row)))
        got = {g.shape[3]: g[0, 0].tolist() for g in merge_groups(srcs[None, None], dst[None, None])}
        assert got == want


def test_merge_groups_bin_every_head_by_width_with_its_own_padding() -> None:
    """The groups of all (layer, head)s at once, against one (layer, head) at a time
    written out plainly: rows by destination, sources ascending, widths powers of two,
    and a head with fewer groups of a width padded with its first source alone."""
    rng = np.random.default_rng(3)
    L, H, n, m = 3, 2, 60, 20
    src = np.stack([np.stack([rng.permutation(n - 1)[:m] for _ in range(H)]) for _ in range(L)])
    dst = np.empty_like(src)
    for li, h in np.ndindex(L, H):
        free = np.setdiff1d(np.arange(n - 1), src[li, h])
        dst[li, h] = rng.choice(free[: 2 + 3 * li + h], m)  # few destinations: wide groups, unequal per head
    got = merge_groups(src, dst)
    widths = [g.shape[3] for g in got]
    assert widths == sorted(set(widths)) and all(w & (w - 1) == 0 for w in widths)
    for li, h in np.ndindex(L, H):
        want: dict[int, list[list[int]]] = {}
        for d in np.unique(dst[li, h]):
            members = [int(d), *sorted(int(x) for x in src[li, h][dst[li, h] == d])]
            w = 1 << (len(members) - 1).bit_length()
            want.setdefault(w, []).append(members + [-1] * (w - len(members)))
        for g in got:
            rows = g[li, h]
            real = rows[rows[:, 1] >= 0]
            assert real.tolist() == want.get(g.shape[3], [])
            pad = rows[real.shape[0]:]
            assert (pad[:, 0] == src[li, h, 0]).all() and (pad[:, 1:] == -1).all()


def test_bad_merges_are_refused() -> None:
    n = 20
    ok = np.full((L, H, 2), [3, 5])
    d = np.full((L, H, 2), [4, 4])
    check_merge(ok, d, L, H, n)
    for s, t, msg in [(np.full((L, H, 2), [3, 3]), d, "only once"),
                      (ok, np.full((L, H, 2), [5, 4]), "destination cannot be a source"),
                      (np.full((L, H, 2), [3, n - 1]), d, "newest cell"),
                      (np.full((L, H, 2), [3, n]), d, "out of range"),
                      (ok[:, :, :1], d, "must both be"),
                      (ok.astype(float), d, "integers"),
                      (ok[:, :, :0], d[:, :, :0], "cannot merge 0")]:
        with pytest.raises(EdgekvError, match=msg):
            check_merge(s, t, L, H, n)


def test_budget_below_what_merging_can_reach_is_a_clear_error() -> None:
    eng = ArrayEngine(*cache(120))
    get_method("chelsea").compress(eng, 16 + 64 + 2)  # a small middle still merges, one cell at a time
    assert eng.n_cells == 82
    with pytest.raises(BudgetError, match="sinks=16"):
        get_method("chelsea").compress(eng, 16 + 64)


def test_due_fires_an_interval_above_the_budget() -> None:
    m = get_method("chelsea", interval=32)
    assert not m.due(1, 500)  # no budget: compress when full
    m.bind(BudgetRule(budget=400))
    assert not m.due(1, 431) and m.due(1, 432)


@pytest.mark.parametrize("params", [dict(chunk=1), dict(r_init=0.6), dict(r_floor=0.0), dict(r_decay=-0.1),
                                    dict(interval=0), dict(window=0)])
def test_bad_parameters(params: dict) -> None:
    with pytest.raises(EdgekvError):
        get_method("chelsea", **params)
