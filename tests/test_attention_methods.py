"""SnapKV and ChunkKV against their equations, on synthetic keys and queries.

Each selection is compared with a direct, loop-by-loop implementation of the
rule written from the paper (ChunkKV's canonical Algorithm 3 over the prefix
before the window) or from kvpress's SnapKVPress (mean over the window's
queries, zero-padded average pool, GQA group mean), and with small cases a
reader can check by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgekv.kvcache.queries import QueryWindow, window_attention
from edgekv.kvcache.snapshot import KVSnapshot
from edgekv.methods import get_method
from edgekv.methods.snapkv import avg_pool

L, H, G, D = 3, 2, 3, 8  # 3 layers, 2 KV heads, 3 query heads per KV head


def snapshot(n: int, n_q: int, seed: int = 0) -> KVSnapshot:
    rng = np.random.default_rng(seed)
    keys = [rng.standard_normal((n, H, D)).astype(np.float32) for _ in range(L)]
    values = [rng.standard_normal((n, H, D)).astype(np.float32) for _ in range(L)]
    q = (rng.standard_normal((L, H * G, n_q, D)) * 2).astype(np.float32)
    win = QueryWindow(n_q, tuple(range(L)), q, np.arange(n - n_q, n, dtype=np.int32))
    return KVSnapshot.from_arrays(keys, values, queries=win)


def loop_attention(snap: KVSnapshot, layer: int, n_q: int) -> np.ndarray:
    """[H * G, n_q, n] softmax probabilities, one query at a time, float64."""
    q, q_pos = snap.queries.last(n_q)
    k = snap.keys(layer).astype(np.float64)
    out = np.zeros((H * G, len(q_pos), snap.n_cells))
    for qh in range(H * G):
        for t, p in enumerate(q_pos):
            logit = snap.kq_scale * (k[:, qh // G] @ q[layer, qh, t].astype(np.float64))
            logit[snap.pos > p] = -np.inf
            e = np.exp(logit - logit.max())
            out[qh, t] = e / e.sum()
    return out


def test_window_attention_is_the_grouped_causal_softmax() -> None:
    snap = snapshot(40, 6)
    for layer in range(L):
        p = loop_attention(snap, layer, 6)
        want = p.sum(axis=1).reshape(H, G, -1).sum(axis=1)
        got = window_attention(snap.queries.q[layer], snap.queries.pos, snap.keys(layer), snap.pos, snap.kq_scale)
        assert np.abs(got - want).max() < 1e-5
        assert np.all(p[:, 0, -5:] == 0)  # the first window query does not see the 5 after it


def test_avg_pool_is_zero_padded_mean() -> None:
    x = np.array([[1.0, 2, 3, 4, 5, 6, 7]])
    assert np.allclose(avg_pool(x, 5), [[6 / 5, 10 / 5, 15 / 5, 20 / 5, 25 / 5, 22 / 5, 18 / 5]])
    assert np.array_equal(avg_pool(x, 1), x)


def kvpress_snapkv_scores(snap: KVSnapshot, layer: int, window: int, kernel: int) -> np.ndarray:
    """SnapKVPress.score written out: [H, n - window] (before its max padding)."""
    n = snap.n_cells
    p = loop_attention(snap, layer, window)[:, :, : n - window]  # queries x prefix keys
    s = p.mean(axis=1)  # mean over the window's queries
    pad = kernel // 2
    padded = np.pad(s, ((0, 0), (pad, pad)))
    pooled = np.array([[padded[h, j : j + kernel].mean() for j in range(n - window)] for h in range(H * G)])
    return pooled.reshape(H, G, -1).mean(axis=1)


@pytest.mark.parametrize("kernel", [1, 5])
def test_snapkv_keeps_kvpress_top_k_per_head(kernel: int) -> None:
    n, w, budget = 120, 16, 50
    snap = snapshot(n, w, seed=kernel)
    m = get_method("snapkv", window=w, kernel=kernel)
    keep = m.select(snap, budget)
    for layer in range(L):
        s = kvpress_snapkv_scores(snap, layer, w, kernel)
        for h in range(H):
            top = np.sort(np.argsort(-s[h], kind="stable")[: budget - w])
            assert np.array_equal(keep[layer, h], np.concatenate([top, np.arange(n - w, n)]))


def test_snapkv_hand_case_keeps_what_the_window_looks_at() -> None:
    """One KV head, keys zero except cell 3 (and 7, weaker): every window query points at them."""
    n, w = 12, 2
    k = np.zeros((n, 1, 4), np.float32)
    k[3, 0, 0], k[7, 0, 0] = 8.0, 4.0
    q = np.zeros((1, 1, w, 4), np.float32)
    q[..., 0] = 2.0  # logit 16*0.5=8 on cell 3, 4 on cell 7, 0 elsewhere (scale 1/2)
    win = QueryWindow(w, (0,), q, np.array([10, 11], np.int32))
    snap = KVSnapshot.from_arrays([k], [k], queries=win)
    keep = get_method("snapkv", window=w, kernel=1).select(snap, 4)
    assert keep[0, 0].tolist() == [3, 7, 10, 11]


def canonical_chunkkv(a: np.ndarray, n: int, w: int, c: int, budget: int) -> list[int]:
    """The spec's Algorithm 3 over the prefix [0, n - w), for one head: chunk sums,
    top floor((budget - w) / c) chunks, plus the window."""
    prefix = n - w
    n_chunks = -(-prefix // c)
    s = [a[i * c : min((i + 1) * c, prefix)].sum() for i in range(n_chunks)]
    k = min(n_chunks, (budget - w) // c)
    top = sorted(np.argsort(-np.array(s), kind="stable")[:k])
    kept = [j for i in top for j in range(i * c, min((i + 1) * c, prefix))]
    return kept + list(range(prefix, n))


def test_chunkkv_equals_the_papers_algorithm_when_the_budget_is_whole_chunks() -> None:
    n, w, c = 196, 16, 10  # the prefix before the window is whole chunks
    budget = w + 7 * c
    snap = snapshot(n, w, seed=3)
    keep = get_method("chunkkv", window=w, chunk=c, per_layer=False).select(snap, budget)
    for layer in range(L):
        a = snap.window_attention(layer, w)
        for h in range(H):
            assert keep[layer, h].tolist() == canonical_chunkkv(a[h], n, w, c, budget)


def test_chunkkv_keeps_whole_chunks_and_one_partial_to_fill_the_budget() -> None:
    n, w, c, budget = 200, 16, 10, 16 + 7 * 10 + 4
    snap = snapshot(n, w, seed=4)
    keep = get_method("chunkkv", window=w, chunk=c, per_layer=False).select(snap, budget)
    assert keep.shape == (L, H, budget)
    for layer in range(L):
        for h in range(H):
            body = keep[layer, h][keep[layer, h] < n - w]
            counts = np.bincount(body // c, minlength=n // c)
            partial = [i for i, x in enumerate(counts) if 0 < x < c]
            assert len(partial) == 1 and counts[partial[0]] == 4
            assert (counts == c).sum() == 7


def test_chunkkv_hand_case() -> None:
    """Chunk scores 2, 10, 0, 4 (chunk 2): with room for 4 cells, chunks 1 and 3 stay."""
    n, w = 10, 1
    snap = snapshot(n, w)
    cell = np.array([1, 1, 5, 5, 0, 0, 2, 2, 0, 9.0])
    for layer in range(L):
        snap._attn[(layer, w)] = np.tile(cell, (H, 1))  # the scores the window would give
    keep = get_method("chunkkv", window=w, chunk=2, per_layer=False).select(snap, 5)
    assert np.all(keep == [2, 3, 6, 7, 9])


def test_chunkkv_per_layer_mode_shares_chunks_across_heads() -> None:
    n, w, c = 200, 16, 20
    snap = snapshot(n, w, seed=5)
    keep = get_method("chunkkv", window=w, chunk=c, per_layer=True).select(snap, 100)
    for layer in range(L):
        assert np.all(keep[layer] == keep[layer, 0])
        assert set(range(n - w, n)) <= set(keep[layer, 0].tolist())


@pytest.mark.parametrize("reuse", [2, 3])
def test_chunkkv_layer_reuse_scores_leaders_only(reuse: int) -> None:
    n, w = 160, 16
    snap = snapshot(n, w, seed=6)
    keep = get_method("chunkkv", window=w, reuse=reuse).select(snap, 60)
    leaders = list(range(0, L, reuse))
    assert snap.scored_layers == leaders
    for layer in range(L):
        assert np.array_equal(keep[layer], keep[layer - layer % reuse])
    alone = get_method("chunkkv", window=w).select(snapshot(n, w, seed=6), 60)
    for layer in leaders:
        assert np.array_equal(keep[layer], alone[layer])


def test_h2o_keeps_the_recent_share_and_the_heaviest_tallies() -> None:
    n = 20
    snap = snapshot(n, 1)
    tally = np.zeros((L, H, n))
    tally[:, 0, [2, 5, 9]] = [3.0, 1.0, 2.0]  # head 0: heavy hitters 2 > 9 > 5
    tally[:, 1, [4, 11]] = [1.0, 5.0]
    snap.tally = tally
    # budget 8, recent 0.5: the 4 newest (16..19) plus the 4 heaviest before them
    keep = get_method("h2o", window=1).select(snap, 8)
    assert keep[0, 0].tolist() == [0, 2, 5, 9, 16, 17, 18, 19]  # ties at 0 go to the earliest cell
    assert keep[0, 1].tolist() == [0, 1, 4, 11, 16, 17, 18, 19]
    # recent 0.25 keeps 2 newest, 6 heavy
    keep = get_method("h2o", window=1, recent=0.25).select(snap, 8)
    assert keep[1, 0].tolist() == [0, 1, 2, 3, 5, 9, 18, 19]


def kvpress_style_compresskv(snap: KVSnapshot, layer: int, heads: list[int], w: int, kernel: int) -> np.ndarray:
    """The paper's online score written out: per retrieval head, attention of the w window
    queries summed, prefix only, zero-padded average pool, then the mean over the heads."""
    n = snap.n_cells
    p = loop_attention(snap, layer, w)  # [H * G, w, n]
    rows = []
    for h in heads:
        c = p[h].sum(axis=0)[: n - w]
        padded = np.pad(c, (kernel // 2, kernel // 2))
        rows.append([padded[j : j + kernel].mean() for j in range(n - w)])
    return np.mean(rows, axis=0)


def test_compresskv_keeps_one_set_per_layer_from_its_retrieval_heads() -> None:
    from edgekv.profiles import HeadProfile

    n, w, budget = 120, 8, 40
    snap = snapshot(n, 16, seed=11)
    scores = np.zeros((L, H * G))
    scores[0, [5, 1, 4, 0]] = [4, 3, 2, 1]  # layer 0: heads 5, 1, 4, 0 (two per KV head)
    scores[1, [2, 3, 0, 1]] = [4, 3, 2, 1]  # layer 1: four heads of KV head 0 and 1
    scores[2, [5]] = [1]  # layer 2: ties after head 5 go to the lower ids
    m = get_method("compresskv", window=w)
    m._profile = HeadProfile("synthetic", "0", list(range(L)), scores.tolist(), 1, 1)
    assert m._profile.top_heads(2, 4) == [5, 0, 1, 2]
    keep = m.select(snap, budget)
    for layer in range(L):
        assert np.all(keep[layer] == keep[layer, 0])  # every KV head keeps the layer's set
        s = kvpress_style_compresskv(snap, layer, m._profile.top_heads(layer, 4), w, 5)
        top = np.sort(np.argsort(-s, kind="stable")[: budget - w])
        assert keep[layer, 0].tolist() == top.tolist() + list(range(n - w, n))


def test_head_attention_is_one_query_head() -> None:
    snap = snapshot(60, 6, seed=12)
    p = loop_attention(snap, 1, 6)
    got = snap.head_attention(1, 6, [4, 0, 5])
    assert np.abs(got - p[[4, 0, 5]].sum(axis=1)).max() < 1e-5
