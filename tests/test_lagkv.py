"""LagKV: the reference vector (docs/methods.md, lagkv), a loop-based implementation of Eqs. 5-9,
incremental == one-shot, the budget fallback, NaN safety, and end-to-end runs
on the real default model (bounded prompts 8x n_ctx, 2000 generated tokens,
q8_0 + flash attention, the CLI)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgekv.config import BudgetRule
from edgekv.errors import BudgetError
from edgekv.kvcache.cells import check_keep
from edgekv.kvcache.snapshot import KVSnapshot
from edgekv.methods import get_method
from edgekv.methods.lagkv import (
    LagKV,
    group_ranks,
    lag_scores,
    partition_scores,
    retained_cells,
)

# -- helpers -------------------------------------------------------------------


def kv(T: int, n_layer: int = 2, H: int = 2, d: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    K = [rng.standard_normal((T, H, d)) * rng.uniform(0.5, 2, (1, H, d)) for _ in range(n_layer)]
    V = [rng.standard_normal((T, H, d)) for _ in range(n_layer)]
    return K, V


def snap_of(K, V, tp: np.ndarray) -> KVSnapshot:
    """The snapshot of a cache whose (layer, head) cell j holds token tp[l, h, j]."""
    hs = np.arange(tp.shape[1])
    return KVSnapshot.from_arrays([k[tp[i].T, hs] for i, k in enumerate(K)],
                                  [v[tp[i].T, hs] for i, v in enumerate(V)], tp.astype(np.int32))


def full_tp(n_layer: int, H: int, T: int) -> np.ndarray:
    return np.broadcast_to(np.arange(T), (n_layer, H, T)).copy()


class Sim:
    """Session.feed's call pattern (ensure room, decode, due, compress) on synthetic K/V."""

    def __init__(self, m: LagKV, K, V, budget=None, ratio=None, capacity=None) -> None:
        self.m, self.K, self.V = m, K, V
        self.budget, self.ratio, self.capacity = budget, ratio, capacity
        m.bind(BudgetRule(budget=budget, ratio=ratio))
        self.tp = np.zeros((len(K), K[0].shape[1], 0), np.int64)
        self.T = self.since = self.calls = self.events = self.peak = 0

    @property
    def n(self) -> int:
        return self.tp.shape[2]

    def compress(self, target=None, scheduled: bool = False) -> None:
        n = self.n
        if target is None:
            target = (self.budget if self.budget is not None
                      else max(1, math.floor(n * (1 - self.ratio))) if self.ratio is not None else n // 2)
        if target >= n:
            return
        self.calls += 1
        keep = self.m.select(snap_of(self.K, self.V, self.tp), target, why="schedule" if scheduled else "budget")
        self.since = 0
        if keep.shape[2] < n:
            check_keep(keep, *self.tp.shape)
            self.tp = np.take_along_axis(self.tp, keep, axis=2)
            self.events += 1

    def feed(self, c: int) -> None:
        while self.capacity is not None and self.n + c > self.capacity:
            before = self.n
            self.compress()
            assert self.n < before, "a full cache must shrink"
        new = np.broadcast_to(np.arange(self.T, self.T + c), self.tp.shape[:2] + (c,))
        self.tp = np.concatenate([self.tp, new], axis=2)
        self.T += c
        self.since += c
        self.peak = max(self.peak, self.n)
        if self.m.due(self.since, self.n):
            self.compress(scheduled=True)


# -- a direct, loop-based implementation of the equations ----------------------


def loop_scores(Z, t0: int, L: int) -> list[float]:
    """Eqs. 5-8 for partition [t0, t0+L) of one head's Z [T, d], reference [t0+L, t0+2L)."""
    d = len(Z[0])
    mn = [min(Z[u][c] for u in range(t0 + L, t0 + 2 * L)) for c in range(d)]
    mx = [max(Z[u][c] for u in range(t0 + L, t0 + 2 * L)) for c in range(d)]
    sds = []
    for t in range(t0, t0 + L):
        zb = [(Z[t][c] - mn[c]) / max(mx[c] - mn[c], 1e-6) for c in range(d)]
        mean = sum(zb) / d
        sds.append(math.sqrt(sum((x - mean) ** 2 for x in zb) / (d - 1)))
    top = max(sds)
    e = [math.exp(x - top) for x in sds]
    return [x / sum(e) for x in e]


def loop_keep(K, V, S: int, L: int, k: int) -> list[int]:
    """One-shot LagKV over one head's whole sequence: kept original positions."""
    T = len(K)
    if T < S + 2 * L:
        return list(range(T))
    n_full = (T - S) // L
    kept = list(range(S))
    for p in range(n_full - 1):
        t0 = S + p * L
        s = [a + b for a, b in zip(loop_scores(K, t0, L), loop_scores(V, t0, L), strict=True)]
        kept += sorted(t0 + i for i in sorted(range(L), key=lambda i: (-s[i], i))[:k])
    return kept + list(range(S + (n_full - 1) * L, T))


# -- the reference vector (docs/methods.md, lagkv) ---------------------------------


def spec_vector():
    H, d, T = 2, 4, 15
    t = np.arange(T)[None, :, None]
    c = np.arange(d)[None, None, :]
    h = np.arange(H)[:, None, None]
    K = np.sin(0.3 * t + c + h) + 0.1 * c
    K[:, 5, :] += [2.0, -1.0, 0.5, 0.0]
    V = np.cos(0.2 * t * (c + 1) + h)
    V[:, 8, 1] += 1.5
    return K.transpose(1, 0, 2), V.transpose(1, 0, 2)  # [T, H, d]


def test_spec_reference_vector() -> None:
    K, V = spec_vector()
    sk = partition_scores(K[2:14], 4)
    sv = partition_scores(V[2:14], 4)
    np.testing.assert_allclose(sk, [[[0.231910, 0.163393, 0.123793, 0.480904],
                                     [0.473433, 0.279290, 0.157868, 0.089409]],
                                    [[0.285028, 0.220949, 0.162584, 0.331439],
                                     [0.593679, 0.254205, 0.105815, 0.046300]]], atol=1e-6)
    np.testing.assert_allclose(sv, [[[0.213806, 0.279200, 0.287538, 0.219456],
                                     [0.345795, 0.305404, 0.182339, 0.166462]],
                                    [[0.346437, 0.291594, 0.213056, 0.148913],
                                     [0.555814, 0.281289, 0.060265, 0.102633]]], atol=1e-6)
    m = get_method("lagkv", sinks=2, L=4, r=0.5, window=1)
    snap = KVSnapshot.from_arrays([K], [V])
    keep = m.step(snap)
    assert keep[0, 0].tolist() == [0, 1, 2, 5, 6, 7, 10, 11, 12, 13, 14]
    assert keep[0, 1].tolist() == [0, 1, 2, 3, 6, 7, 10, 11, 12, 13, 14]
    assert keep.shape[2] == retained_cells(15, 2, 4, 2) == 11
    m.bind(BudgetRule(ratio=0.5))  # --ratio 0.5 is r = 0.5; LagKV's own schedule asks for it
    assert m.due(15, 15)
    assert np.array_equal(m.select(snap, 7, why="schedule"), keep)  # its own step ignores the session's target


@pytest.mark.parametrize("seed", range(3))
def test_scores_and_selection_match_loop_implementation(seed: int) -> None:
    S, L, k, T = 3, 7, 2, 60
    K, V = kv(T, n_layer=2, H=3, d=5, seed=seed)
    m = LagKV(sinks=S, L=L, r=k / L, window=1)
    keep = m.step(snap_of(K, V, full_tp(2, 3, T)))
    for il in range(2):
        for h in range(3):
            Kh, Vh = K[il][:, h].tolist(), V[il][:, h].tolist()
            assert keep[il, h].tolist() == loop_keep(Kh, Vh, S, L, k)
            got = lag_scores(K[il][S:S + L, h], K[il][S + L:S + 2 * L, h])
            np.testing.assert_allclose(got, loop_scores(Kh, S, L), rtol=1e-12)
    assert keep.shape[2] == retained_cells(T, S, L, k)


@pytest.mark.parametrize("seed", range(3))
def test_compiled_ranks_equal_the_reference_scores(seed: int) -> None:
    # the compiled kernel the steps and shrinks run ranks partitions exactly as Eqs. 5-9 in numpy
    rng = np.random.default_rng(seed)
    H, q, L, d = 2, 3, 16, 8
    K = rng.standard_normal(((q + 1) * L, H, d)).astype(np.float32)
    V = rng.standard_normal(((q + 1) * L, H, d)).astype(np.float32)
    K[5, 0], V[5, 0] = K[6, 0], V[6, 0]  # a tie: the earlier token ranks first
    cells = np.arange((q + 1) * L, dtype=np.int64).reshape(q + 1, L)
    rank = group_ranks(KVSnapshot.from_arrays([K], [V]), np.broadcast_to(cells, (1, H, q + 1, L)))[0]
    for h in range(H):
        kb, vb = K[:, h].reshape(q + 1, L, d), V[:, h].reshape(q + 1, L, d)
        s = lag_scores(kb[:-1], kb[1:]) + lag_scores(vb[:-1], vb[1:])
        want = np.argsort(np.argsort(-s, axis=-1, kind="stable"), axis=-1, kind="stable")
        assert np.array_equal(rank[h], want)


@pytest.mark.parametrize("seed", range(4))
def test_compiled_ranks_equal_the_reference_on_non_finite_and_constant_channels(seed: int) -> None:
    # the kernel's NaN policy (a NaN in the reference spoils its channel; non-finite
    # tokens rank lowest), constant channels and infinite values, against numpy's Eqs. 5-9
    rng = np.random.default_rng(100 + seed)
    H, q, L, d = 2, 3, 16, 8
    K = rng.standard_normal(((q + 1) * L, H, d)).astype(np.float32)
    V = rng.standard_normal(((q + 1) * L, H, d)).astype(np.float32)
    K[:, 0, 3] = 0.25  # a constant channel in head 0
    K[L + 2, 1, 5] = np.nan  # a NaN in partition 1: partition 0's reference channel 5 and a token of 1
    V[3, 0, 1] = np.inf  # an infinite member
    V[2 * L: 3 * L, 1, 0] = -np.inf  # a reference channel all -inf (partition 1 against 2)
    if seed % 2:
        K[3 * L:, 0] = np.nan  # the last reference all NaN: partition 2 scores uniformly in K
    cells = np.arange((q + 1) * L, dtype=np.int64).reshape(q + 1, L)
    rank = group_ranks(KVSnapshot.from_arrays([K], [V]), np.broadcast_to(cells, (1, H, q + 1, L)))[0]
    with np.errstate(invalid="ignore", over="ignore"):
        for h in range(H):
            kb, vb = K[:, h].reshape(q + 1, L, d), V[:, h].reshape(q + 1, L, d)
            s = lag_scores(kb[:-1], kb[1:]) + lag_scores(vb[:-1], vb[1:])
            want = np.argsort(np.argsort(-s, axis=-1, kind="stable"), axis=-1, kind="stable")
            assert np.array_equal(rank[h], want), h


# -- incremental == one-shot -----------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(S=st.integers(0, 5), L=st.integers(2, 9), kk=st.integers(0, 9), T=st.integers(1, 160),
       chunks=st.lists(st.integers(1, 40), min_size=1, max_size=30), d=st.integers(2, 6),
       seed=st.integers(0, 10_000))
def test_incremental_equals_one_shot(S, L, kk, T, chunks, d, seed) -> None:
    k = min(kk, L - 1)  # k == L removes nothing (covered below)
    K, V = kv(T, n_layer=2, H=2, d=d, seed=seed)
    m = LagKV(sinks=S, L=L, r=k / L, window=1)
    sim = Sim(m, K, V, ratio=1 - k / L)
    i = 0
    while sim.T < T:
        sim.feed(min(chunks[i % len(chunks)], T - sim.T))
        i += 1
        # After every step the cache is exactly a one-shot pass over the prefix.
        one = LagKV(sinks=S, L=L, r=k / L, window=1).step(snap_of(K, V, full_tp(2, 2, sim.T)))
        assert np.array_equal(sim.tp, one)
        assert sim.n == retained_cells(sim.T, S, L, k)
    assert sim.calls == sim.events  # due() never asks for a compression that removes nothing
    assert sim.tp[1, 1].tolist() == loop_keep(K[1][:, 1].tolist(), V[1][:, 1].tolist(), S, L, k)


def test_due_fires_when_a_successor_completes() -> None:
    S, L, T = 4, 8, 120
    K, V = kv(T)
    sim = Sim(LagKV(sinks=S, L=L, r=0.25), K, V, ratio=0.75)
    fired = []
    for _ in range(T):
        before = sim.events
        sim.feed(1)
        if sim.events > before:
            fired.append(sim.T)
    assert fired == list(range(S + 2 * L, T + 1, L))
    assert sim.calls == len(fired)


def test_r_one_never_schedules_a_compression() -> None:
    K, V = kv(80)
    sim = Sim(LagKV(sinks=2, L=8, r=1.0), K, V)
    for _ in range(80):
        sim.feed(1)
    assert sim.calls == 0 and sim.n == 80


def test_ratio_sets_r_and_budget_leaves_it() -> None:
    m = LagKV(L=64, r=0.5)
    m.bind(BudgetRule(ratio=0.875))
    assert m.keep_per_partition == 8
    m.bind(BudgetRule(budget=500))
    assert m.keep_per_partition == 32
    m.bind(BudgetRule(ratio=0.9))
    assert m.keep_per_partition == 6  # floor(0.1 * 64), robust to 1 - 0.9 = 0.0999...


# -- statelessness ---------------------------------------------------------------


@pytest.mark.parametrize("mode", [{"ratio": 0.75}, {"budget": 90}])
def test_restore_into_a_fresh_method_continues_identically(mode) -> None:
    T = 500
    K, V = kv(T, seed=4)
    a = Sim(LagKV(sinks=4, L=16, r=0.25, window=8), K, V, capacity=120, **mode)
    for _ in range(200):
        a.feed(3)
        if a.T >= 250:
            break
    b = Sim(LagKV(sinks=4, L=16, r=0.25, window=8), K, V, capacity=120, **mode)  # "restored" from a's cache
    b.tp, b.T = a.tp.copy(), a.T
    while a.T < T:
        a.feed(1)
        b.feed(1)
        assert np.array_equal(a.tp, b.tp)


# -- budget mode -----------------------------------------------------------------


def test_budget_mode_bounded_with_uniform_partitions() -> None:
    S, L, k, T, budget = 4, 16, 4, 900, 100
    K, V = kv(T, seed=1)
    sim = Sim(LagKV(sinks=S, L=L, r=k / L, window=8), K, V, budget=budget, capacity=budget + 8)
    for _ in range(T):
        sim.feed(1)
        assert sim.n <= budget
        # Sinks and LagKV's window (the last complete partition + remainder) stay.
        n_full = max(0, (sim.T - S) // L)
        start = S + (n_full - 1) * L if n_full >= 2 else 0
        assert np.all(sim.tp[:, :, : min(S, sim.T)] == np.arange(min(S, sim.T)))
        assert np.all(sim.tp[:, :, -(sim.T - start):] == np.arange(start, sim.T))
    assert sim.peak <= budget + 1
    # Room is made for the next L tokens: about one compaction per L tokens, not per token.
    assert sim.events <= T // L + 3
    # Water-filling: compressed partitions (those holding < L tokens) differ by
    # at most one token, older <= newer.
    for il in range(2):
        for h in range(2):
            tp = sim.tp[il, h]
            c = np.bincount((tp[tp >= S] - S) // L)
            c = c[: np.flatnonzero(c < L).max() + 1]
            assert c.max() - c.min() <= 1 and np.all(np.diff(c) >= 0), c
            assert c.min() >= 1  # the budget still covers every partition of the history
    assert not np.array_equal(sim.tp[0, 0], sim.tp[0, 1])  # heads choose independently


def test_shrink_keeps_top_survivors_of_each_partition() -> None:
    """Explicit target on a compressed cache: each partition keeps the best of
    its survivors by Eqs. 5-9 against the next partition's survivors."""
    S, L, k = 2, 8, 4
    T = S + 5 * L + 3
    K, V = kv(T, n_layer=1, H=2, d=6, seed=7)
    m = LagKV(sinks=S, L=L, r=k / L, window=4)
    tp = np.take_along_axis(full_tp(1, 2, T), m.step(snap_of(K, V, full_tp(1, 2, T))), axis=2)
    n = tp.shape[2]
    assert n == S + 4 * k + L + 3
    goal = n - 4 * k + 4 * 2  # every compressed partition down to 2 survivors
    keep = m.select(snap_of(K, V, tp), goal)
    check_keep(keep, 1, 2, n)
    got = np.take_along_axis(tp, keep, axis=2)
    for h in range(2):
        t = tp[0, h]
        for p in range(4):
            cur = t[(t >= S + p * L) & (t < S + (p + 1) * L)]
            ref = t[(t >= S + (p + 1) * L) & (t < S + (p + 2) * L)]
            s = (lag_scores(K[0][cur, h], K[0][ref, h]) + lag_scores(V[0][cur, h], V[0][ref, h]))
            want = np.sort(cur[np.argsort(-s, kind="stable")[:2]])
            g = got[0, h]
            assert g[(g >= S + p * L) & (g < S + (p + 1) * L)].tolist() == want.tolist()
    # Uneven goal: the oldest partitions lose first.
    keep = m.select(snap_of(K, V, tp), n - 4 * k + 4 * 2 + 2)
    g = np.take_along_axis(tp, keep, axis=2)[0, 0]
    assert np.bincount((g[(g >= S) & (g < S + 4 * L)] - S) // L).tolist() == [2, 2, 3, 3]


def test_target_below_the_window_slides_it_and_below_protected_raises() -> None:
    S, L, T = 4, 16, 200
    K, V = kv(T)
    m = LagKV(sinks=S, L=L, r=0.25, window=10)
    n_full = (T - S) // L
    start = S + (n_full - 1) * L  # LagKV's window: 20 tokens
    keep = m.select(snap_of(K, V, full_tp(2, 2, T)), S + 6 + (T - start))
    # One survivor in each of the six newest compressed partitions, then sinks + window.
    assert np.all(keep[:, :, :S] == np.arange(S)) and np.all(keep[:, :, -(T - start):] == np.arange(start, T))
    p = (keep[:, :, S:S + 6] - S) // L
    assert np.all(p == np.arange(n_full - 7, n_full - 1))
    # Below sinks + window: the compressed partitions are gone and the window slides.
    keep = m.select(snap_of(K, V, full_tp(2, 2, T)), 20)
    assert np.all(keep == np.concatenate([np.arange(S), np.arange(T - 16, T)]))
    with pytest.raises(BudgetError, match="always keeps"):
        m.select(snap_of(K, V, full_tp(2, 2, T)), S + 10 - 1)


def test_budget_too_small_for_the_window_is_a_clear_error() -> None:
    m = LagKV(sinks=16, L=64)
    with pytest.raises(BudgetError, match=r"--budget >= 143 or a smaller L"):
        BudgetRule.make(m, budget=142).build()
    assert BudgetRule.make(m, budget=143).build() is m


def test_foreign_compaction_is_handled() -> None:
    """A cache compacted by another method (different tokens per head, sinks
    partly gone): LagKV still returns a valid selection."""
    T = 400
    K, V = kv(T, seed=2)
    tp = full_tp(2, 2, T)
    tp = np.take_along_axis(tp, get_method("knorm", sinks=2, window=60).select(snap_of(K, V, tp), 300), 2)
    m = LagKV(sinks=4, L=16, r=0.25, window=8)
    for target in (299, 150, 40):
        keep = m.select(snap_of(K, V, tp), target)
        check_keep(keep, 2, 2, 300)
        assert keep.shape[2] <= target
        assert np.all(np.take_along_axis(tp, keep, 2)[:, :, :2] == [0, 1])


def test_invalid_parameters() -> None:
    for bad in ({"L": 0}, {"r": 1.5}, {"r": -0.1}, {"sinks": -1}):
        with pytest.raises(Exception, match="bad parameters for lagkv"):
            get_method("lagkv", **bad)


# -- NaN safety --------------------------------------------------------------------


def test_constant_channels_are_nan_free() -> None:
    S, L, T = 2, 8, 2 + 3 * 8 + 1
    K, V = kv(T, n_layer=1, H=2, d=4, seed=3)
    K[0][:, :, 1] = 0.5  # a channel constant everywhere: max == min in every reference
    V[0][:, 0, :] = 1.0  # head 0: every value channel constant
    K[0][S + 3, 0, 1] = 0.9  # ...and one token that deviates from a constant channel
    m = LagKV(sinks=S, L=L, r=0.25, window=1)
    snap = snap_of(K, V, full_tp(1, 2, T))
    for z in (K[0], V[0]):
        s = partition_scores(z[S:S + 3 * L], L)
        assert np.all(np.isfinite(s))
        np.testing.assert_allclose(s.sum(-1), 1.0)
    sv = partition_scores(V[0][S:S + 3 * L], L)
    np.testing.assert_allclose(sv[0], 1 / L)  # all-constant values: uniform, no NaN
    keep = m.step(snap)
    check_keep(keep, 1, 2, T)
    assert S + 3 in keep[0, 0]  # the deviating token is the partition's outlier
    # Everything constant: ties go to the earliest tokens of each partition.
    Kc = [np.ones_like(K[0])]
    keep = LagKV(sinks=S, L=L, r=0.25, window=1).step(snap_of(Kc, Kc, full_tp(1, 2, T)))
    assert keep[0, 0].tolist()[:S + 4] == [0, 1, 2, 3, 10, 11]


def test_non_finite_values_rank_lowest_and_empty_references_are_uniform() -> None:
    rng = np.random.default_rng(0)
    cur, ref = rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 4))
    cur[0, 2, 1] = np.nan
    s = lag_scores(cur, ref)
    assert np.all(np.isfinite(s)) and s[0, 2] == 0.0
    np.testing.assert_allclose(s.sum(-1), 1.0)
    s = lag_scores(cur[1:], ref[1:], np.ones((1, 5), bool), np.zeros((1, 5), bool))
    np.testing.assert_allclose(s, 0.2)


def test_head_dim_one() -> None:
    K, V = kv(60, d=1)
    keep = LagKV(sinks=2, L=8, r=0.5, window=1).select(snap_of(K, V, full_tp(2, 2, 60)), 40)
    check_keep(keep, 2, 2, 60)


# -- the real default model ----------------------------------------------------------

# One thread: the decodes here are small batches that gain little from two, and
# two spinning threads collapse (< 1 tok/s measured) when the 2 cores are shared.
THREADS = 1
TEXT = " ".join(f"Record {i}: the ship {i % 7} carried {i * 3} barrels of oil to port {i % 11}." for i in range(400))


@pytest.mark.slow
def test_prompt_eight_times_n_ctx_stays_bounded_and_generates(smollm2) -> None:
    from edgekv.session import Session

    n_ctx, budget, L = 128, 100, 32
    toks = smollm2.tokenize(TEXT)[: 8 * n_ctx + 17]
    assert len(toks) >= 8 * n_ctx
    with Session(smollm2, method="lagkv", budget=budget, n_ctx=n_ctx, chunk=32, n_threads=THREADS,
                 method_params={"L": L, "r": 0.25}) as s:
        seen = []
        s.feed(toks, progress=lambda done, total: seen.append(s.engine.n_cells))
        assert s.stats.tokens_seen == len(toks)
        assert s.stats.peak_cells <= n_ctx and max(seen) <= budget
        assert s.stats.compressions >= len(toks) // L - 8
        assert s.ctx.pos_max() == len(toks) - 1
        tp = s.engine.snapshot().token_pos
        assert np.all(tp[:, :, :16] == np.arange(16))  # sinks
        n_full = (len(toks) - 16) // L
        start = 16 + (n_full - 1) * L
        assert np.all(tp[:, :, -(len(toks) - start):] == np.arange(start, len(toks)))  # window
        out = "".join(s.generate(16))
        assert out.strip()
        assert s.stats.peak_cells <= n_ctx


@pytest.mark.slow
def test_ratio_mode_is_the_paper_and_one_shot_equals_the_session(smollm2) -> None:
    """Default prefill (one chunk) then LagKV: the cache holds Eq. 10's count and
    exactly the tokens LagKV picks from a full snapshot of the same prefill."""
    from edgekv.session import Session

    toks = smollm2.tokenize(TEXT)[:700]
    L, R = 64, 0.75
    with Session(smollm2, method="full", n_ctx=1024, chunk=700, n_threads=THREADS) as ref:
        ref.feed(toks)
        want = np.take_along_axis(ref.engine.snapshot().token_pos,
                                  LagKV(L=L, r=1 - R).step(ref.engine.snapshot()), axis=2)
    with Session(smollm2, method="lagkv", ratio=R, n_ctx=1024, chunk=700, n_threads=THREADS,
                 method_params={"L": L}) as s:
        s.feed(toks)
        assert s.engine.n_cells == retained_cells(700, 16, L, 16)
        got = s.engine.snapshot().token_pos
        np.testing.assert_array_equal(got, want)
        assert not np.array_equal(got[0, 0], got[0, 1])
        # Decoding: one more partition every L tokens (Eq. 10 holds throughout).
        n = 0
        for n, _ in enumerate(s.generate_tokens(2 * L), start=1):  # each token is fed before it is yielded
            assert s.engine.n_cells == retained_cells(700 + n, 16, L, 16)
        assert s.engine.n_cells == retained_cells(700 + n, 16, L, 16)
        assert s.stats.compressions >= 2


@pytest.mark.slow
def test_two_thousand_generated_tokens_stay_bounded(smollm2) -> None:
    from edgekv.session import Session

    n_ctx, budget, L = 512, 448, 64
    with Session(smollm2, method="lagkv", budget=budget, n_ctx=n_ctx, n_threads=THREADS,
                 method_params={"L": L, "r": 0.25}) as s:
        s.feed(smollm2.tokenize("Write a very long story about a lighthouse keeper and the sea."))
        for _ in range(2000):
            logits = s.logits()
            order = np.argsort(-logits)
            tok = int(next(t for t in order[:8] if not smollm2.is_eog(int(t))))
            s.feed([tok])
            assert s.engine.n_cells <= budget and s.stats.cells <= budget
            assert s.stats.peak_cells <= n_ctx
        assert s.stats.tokens_seen >= 2000
        assert s.ctx.pos_max() == s.stats.tokens_seen - 1
        # At most one compaction per L tokens (not one per token), and a steady
        # state of one every L tokens once the budget is reached.
        ev = s.stats.events
        assert 10 <= len(ev) <= s.stats.tokens_seen // L + 1
        assert all(b - a == L for (a, _, _), (b, _, _) in zip(ev[-8:], ev[-7:], strict=False))


@pytest.mark.slow
def test_q8_0_cache_with_flash_attention(smollm2) -> None:
    from edgekv.session import Session

    toks = smollm2.tokenize(TEXT)[:600]
    with Session(smollm2, method="lagkv", budget=300, n_ctx=364, cache_type_k="q8_0",
                 cache_type_v="q8_0", flash_attn="on", n_threads=THREADS, method_params={"L": 64}) as s:
        s.feed(toks)
        assert s.stats.compressions >= 2 and s.stats.peak_cells <= 364
        snap = s.engine.snapshot()
        assert np.all(np.isfinite(snap.keys(3))) and np.all(np.isfinite(snap.values(3)))
        out = "".join(s.generate(12))
        assert out.strip()
        assert s.engine.n_cells <= 300


@pytest.mark.slow
def test_cli_generate_with_lagkv(smollm2_path, tmp_path) -> None:
    prompt = tmp_path / "p.txt"
    prompt.write_text(TEXT[:2500])
    stats = tmp_path / "stats.json"
    exe = Path(sys.executable).parent / "edgekv"
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    r = subprocess.run([str(exe), "generate", "--prompt-file", str(prompt), "--method", "lagkv",
                        "--param", "L=64", "--param", "r=0.25", "--budget", "300", "--n-ctx", "364",
                        "--max-tokens", "16", "--threads", str(THREADS), "--stats-json", str(stats)],
                       capture_output=True, text=True, timeout=300, env=env, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    s = json.loads(stats.read_text())
    assert s["compressions"] >= 1 and s["peak_cells"] <= 364 and s["cells"] <= 300
    r = subprocess.run([str(exe), "generate", "--prompt", "hi", "--method", "lagkv", "--budget", "200"],
                       capture_output=True, text=True, timeout=120, env=env, check=False)
    assert r.returncode == 2 and "smaller L" in r.stderr and "Traceback" not in r.stderr
