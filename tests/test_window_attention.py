"""The observation window and the attention it pays, on the real model and cache.

Window attention (what SnapKV, ChunkKV and H2O rank cells by) must be the same
number whichever engine computes it: the state engine in numpy over the
snapshot's dequantised keys, the native engine on the device over the cache's
own (quantised, Hadamard-rotated) rows. Both are checked against a float64
loop over the captured queries and the cached keys, on f16 and q8_0 caches,
with flash attention on and off (the capture must see the same queries
either way), on SmolLM2 (GQA: 9 query heads on 3 KV heads) and on Gemma 3's
iSWA cache (global layers only). The window is cache state: it survives
save/restore and session files.
"""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import prefill

from edgekv import Session
from edgekv.errors import EdgekvError
from edgekv.kvcache import make_engine
from edgekv.llama import Context

pytestmark = pytest.mark.kernels  # window attention against llama.cpp's

TEXT = ("The lighthouse keeper wrote down every ship that passed, its flag, its cargo and the hour. "
        "On stormy nights the entries grew short. ") * 20
W = 24


def reference(q: np.ndarray, q_pos: np.ndarray, k: np.ndarray, k_pos: np.ndarray, scale: float) -> np.ndarray:
    """float64 loop: per KV head, sum over its query heads and the queries of the softmax row."""
    n_head, n_q, _ = q.shape
    n, H, _ = k.shape
    g = n_head // H
    out = np.zeros((H, n))
    for qh in range(n_head):
        h = qh // g
        for t in range(n_q):
            logit = scale * (k[:, h].astype(np.float64) @ q[qh, t].astype(np.float64))
            logit[k_pos > q_pos[t]] = -np.inf
            p = np.exp(logit - logit.max())
            out[h] += p / p.sum()
    return out


CASES = [("state", "f16", "off"), ("state", "q8_0", "on"), ("native", "f16", "off"), ("native", "f16", "on"),
         ("native", "q8_0", "on")]


@pytest.mark.parametrize(("engine", "ct", "fa"), CASES, ids=[f"{e}-{c}-fa_{f}" for e, c, f in CASES])
def test_window_attention_equals_float64_from_captured_queries(smollm2, engine, ct, fa) -> None:
    ctx = Context(smollm2, n_ctx=512, n_batch=128, cache_type_k=ct, cache_type_v=ct, flash_attn=fa, n_threads=2)
    eng = make_engine(ctx, engine)
    assert eng.name == engine
    eng.observe(W)
    toks = smollm2.tokenize(TEXT, add_special=True)[:300]
    prefill(eng, toks)  # 128 + 128 + 44: the window spans the last two decodes
    snap = eng.snapshot()
    q, q_pos = snap.queries.last(W)
    assert q.shape == (smollm2.arch.n_layer, smollm2.arch.n_head, W, smollm2.arch.head_dim_k)
    assert np.array_equal(q_pos, np.arange(len(toks) - W, len(toks)))
    for layer in (0, 7, 29):
        ref = reference(q[layer], q_pos, snap.keys(layer), snap.pos, 1 / np.sqrt(smollm2.arch.head_dim_k))
        got = snap.window_attention(layer, W)
        assert got.shape == ref.shape
        assert np.allclose(got.sum(axis=1).sum(), W * smollm2.arch.n_head)  # every query row sums to 1
        assert np.abs(got - ref).max() < 1e-4, layer
    # single query heads (CompressKV's retrieval heads): 0, 1, 2 share KV head 0
    heads = [0, 1, 2, 5]
    got = snap.head_attention(7, W, heads)
    scale = 1 / np.sqrt(smollm2.arch.head_dim_k)
    for i, h in enumerate(heads):
        g = h // (smollm2.arch.n_head // smollm2.arch.n_head_kv)
        ref = reference(q[7][h : h + 1], q_pos, snap.keys(7)[:, g : g + 1], snap.pos, scale)[0]
        assert np.abs(got[i] - ref).max() < 1e-4, h
    # fewer queries than recorded: the newest ones
    ref = reference(q[3][:, -5:], q_pos[-5:], snap.keys(3), snap.pos, 1 / np.sqrt(smollm2.arch.head_dim_k))
    assert np.abs(snap.window_attention(3, 5) - ref).max() < 1e-4
    ctx.close()


def test_native_score_op_scores_only_the_layers_it_is_given(smollm2) -> None:
    ctx = Context(smollm2, n_ctx=256, n_batch=128, n_threads=2)
    eng = make_engine(ctx, "native")
    eng.observe(8)
    prefill(eng, smollm2.tokenize(TEXT, add_special=True)[:160])
    q, q_pos = eng.window.last(8)
    some = eng.score(q, q_pos, layers=[2, 5])
    every = eng.score(q, q_pos)
    scored = ~np.isnan(some).all(axis=(1, 2))
    assert np.flatnonzero(scored).tolist() == [2, 5]
    assert np.array_equal(some[[2, 5]], every[[2, 5]])
    with pytest.raises(EdgekvError, match="layers must be in"):
        eng.score(q, q_pos, layers=[30])
    ctx.close()


@pytest.mark.parametrize("engine", ["state", "native"])
def test_prefetching_every_layer_gives_the_layer_by_layer_scores(smollm2, engine) -> None:
    """ProtoKV asks for every layer's window attention in one call: the same floats as
    one call per layer, each layer scored once."""
    ctx = Context(smollm2, n_ctx=256, n_batch=128, n_threads=2)
    eng = make_engine(ctx, engine)
    eng.observe(8)
    prefill(eng, smollm2.tokenize(TEXT, add_special=True)[:160])
    one, every = eng.snapshot(), eng.snapshot()
    want = [one.window_attention(layer, 8) for layer in range(one.n_layer)]
    every.window_attention(4, 8)
    every.prefetch_window_attention(8)
    assert sorted(every.scored_layers) == list(range(every.n_layer)) and every.scored_layers[0] == 4
    for layer in range(every.n_layer):
        assert np.array_equal(every.window_attention(layer, 8), want[layer]), layer
    assert len(every.scored_layers) == every.n_layer  # nothing scored twice
    ctx.close()


def test_gemma3_window_attention_on_the_global_layers(gemma3) -> None:
    """iSWA: the snapshot holds the full-attention layers only; the window's rows follow them."""
    info = gemma3.info
    ctx = Context(gemma3, n_ctx=512, n_batch=128, n_threads=2)
    eng = make_engine(ctx, "auto")
    assert eng.name == "state"
    eng.observe(W)
    toks = gemma3.tokenize(TEXT, add_special=True)[:300]
    prefill(eng, toks)
    snap = eng.snapshot()
    assert eng.window.layers == info.global_layers
    q, q_pos = snap.queries.last(W)
    assert q.shape[:2] == (len(info.global_layers), info.n_head)
    for row in range(snap.n_layer):
        ref = reference(q[row], q_pos, snap.keys(row), snap.pos, info.kq_scale)
        assert np.abs(snap.window_attention(row, W) - ref).max() < 1e-4
    ctx.close()


@pytest.mark.parametrize("engine", ["state", "native"])
def test_window_survives_save_restore_and_session_files(smollm2, tmp_path, engine) -> None:
    toks = smollm2.tokenize(TEXT, add_special=True)[:200]
    with Session(smollm2, method="snapkv", budget=150, n_ctx=400, engine=engine) as s:
        assert s.engine.window.size == 64
        s.feed(toks)
        q0, p0 = s.engine.window.q.copy(), s.engine.window.pos.copy()
        assert np.array_equal(p0, np.arange(200 - 64, 200))
        saved = s.save()
        s.feed(toks[:10])
        assert s.engine.window.pos[-1] == 209
        s.restore(saved)
        assert np.array_equal(s.engine.window.q, q0) and np.array_equal(s.engine.window.pos, p0)
        s.save_file(tmp_path / "w.ekv")
        s.reset()
        assert s.engine.window.n == 0
    with Session(smollm2, method="snapkv", budget=150, n_ctx=400, engine=engine) as s2:
        s2.load_file(tmp_path / "w.ekv")
        assert np.array_equal(s2.engine.window.q, q0) and np.array_equal(s2.engine.window.pos, p0)
        s2.compress()
        assert s2.engine.n_cells == 150


def test_attention_method_without_recorded_queries_is_a_clear_error(smollm2) -> None:
    with Session(smollm2, method="full", n_ctx=300) as s:
        s.feed(smollm2.tokenize(TEXT, add_special=True)[:200])
        s.use("snapkv", budget=150)  # starts recording now: the prefill has no queries
        with pytest.raises(EdgekvError, match="no queries were recorded"):
            s.compress()


@pytest.mark.parametrize(("engine", "ct", "fa"), [("state", "f16", "off"), ("native", "f16", "off"),
                                                  ("native", "q8_0", "on")])
def test_tally_is_the_attention_of_every_query_so_far(smollm2, engine, ct, fa) -> None:
    """H2O's tally after a prefill in chunks equals the causal attention of all its
    queries over the final cache; after a compaction it follows the kept cells, and the
    next decodes add their attention over the compacted cache."""
    n = 200
    ctx = Context(smollm2, n_ctx=512, n_batch=128, cache_type_k=ct, cache_type_v=ct, flash_attn=fa, n_threads=2)
    eng = make_engine(ctx, engine)
    eng.observe(n, tally=True)  # a window as long as the prefill keeps every query for the reference
    toks = smollm2.tokenize(TEXT, add_special=True)
    prefill(eng, toks[:n], batch=64)
    snap = eng.snapshot()
    q, q_pos = snap.queries.last(n)
    # Without flash attention the tally sums the model's own softmax, and ggml's CPU product
    # of an F16 K rounds the queries to F16 first: the reference takes them so (off by up to
    # 5e-4 of a cell's tally otherwise). With flash attention the engine scores the queries.
    as_computed = (lambda x: x.astype(np.float16).astype(np.float32)) if (ct, fa) == ("f16", "off") else (lambda x: x)
    q = as_computed(q)
    scale = 1 / np.sqrt(smollm2.arch.head_dim_k)
    for layer in (0, 15, 29):
        ref = reference(q[layer], q_pos, snap.keys(layer), snap.pos, scale)
        assert np.abs(snap.tally[layer] - ref).max() < 1e-3, layer
    # compaction: the tally is gathered with the cells
    before = snap.tally.copy()
    keep = np.stack([np.stack([np.sort(np.random.default_rng(il * 7 + h).choice(n - 1, 119, replace=False))
                               for h in range(3)]) for il in range(30)])
    keep = np.concatenate([keep, np.full((30, 3, 1), n - 1)], axis=2)
    eng.compact(keep)
    assert np.array_equal(eng.snapshot().tally, np.take_along_axis(before, keep, axis=2))
    # four more tokens add their attention over the compacted cache
    eng.decode(toks[n : n + 4], n)
    snap2 = eng.snapshot()
    q2, p2 = snap2.queries.last(4)
    q2 = as_computed(q2)
    gathered = np.take_along_axis(before, keep, axis=2)
    for layer in (0, 29):
        add = reference(q2[layer], p2, snap2.keys(layer), snap2.pos, scale)
        want = np.concatenate([gathered[layer], np.zeros((3, 4))], axis=1) + add
        assert np.abs(snap2.tally[layer] - want).max() < 1e-3
    ctx.close()


def test_h2o_session_keeps_its_tally_through_files(smollm2, tmp_path) -> None:
    toks = smollm2.tokenize(TEXT, add_special=True)[:300]
    with Session(smollm2, method="h2o", budget=128, n_ctx=256) as s:
        s.feed(toks)  # compresses when full: bounded memory
        assert s.stats.compressions >= 1 and s.engine.n_cells <= 256
        tally = s.engine.snapshot().tally  # a snapshot places the attention captured since the compression
        assert tally.shape[2] == s.engine.n_cells
        s.save_file(tmp_path / "h.ekv")
    with Session(smollm2, method="h2o", budget=128, n_ctx=256) as s2:
        s2.load_file(tmp_path / "h.ekv")
        assert np.allclose(s2.engine.tally.scores, tally, rtol=1e-6)  # stored as float32


@pytest.mark.parametrize("method", ["snapkv", "chunkkv", "h2o"])
def test_attention_methods_run_on_gemma3_state_engine(gemma3, method) -> None:
    """iSWA: the state engine scores the global layers; the sliding-window cache is untouched."""
    toks = gemma3.tokenize(TEXT, add_special=True)[:400]
    with Session(gemma3, method=method, budget=200, n_ctx=320) as s:
        assert s.engine.name == "state"
        s.feed(toks)
        assert s.stats.compressions >= 1 and s.engine.n_cells <= 320
        assert s.engine.snapshot().n_layer == len(gemma3.info.global_layers)
        assert "".join(s.generate(4))


def test_context_shift_clears_the_window(smollm2) -> None:
    """Shifted positions break the recorded queries' positions and RoPE phases: they go."""
    ctx = Context(smollm2, n_ctx=256, n_batch=128, n_threads=2)
    eng = make_engine(ctx, "state")
    eng.observe(16)
    prefill(eng, smollm2.tokenize(TEXT, add_special=True)[:200])
    assert eng.window.n == 16
    eng.shift(4, 60)
    assert eng.window.n == 0 and eng.n_cells == 140
    ctx.close()


def test_a_saved_window_is_adopted_by_a_session_that_was_not_recording(smollm2, tmp_path) -> None:
    toks = smollm2.tokenize(TEXT, add_special=True)[:200]
    with Session(smollm2, method="snapkv", budget=150, n_ctx=400) as s:
        s.feed(toks)
        s.save_file(tmp_path / "a.ekv")
    with Session(smollm2, method="full", n_ctx=400) as s2:
        assert s2.engine.window is None
        s2.load_file(tmp_path / "a.ekv")
        assert s2.engine.window is not None and s2.engine.window.n == 64
        s2.use("snapkv", budget=150)
        s2.compress()
        assert s2.engine.n_cells == 150


def test_h2o_refuses_a_tally_that_started_late(smollm2) -> None:
    with Session(smollm2, method="full", n_ctx=300) as s:
        s.feed(smollm2.tokenize(TEXT, add_special=True)[:200])
        s.use("h2o", budget=150)  # the tally starts now: the 200 cells have none
        with pytest.raises(EdgekvError, match="tally started later"):
            s.compress()


def test_softmax_sums_are_the_models_own_softmax(smollm2) -> None:
    """The capture's reduced mode (H2O's tally from llama.cpp's softmax): per head, the
    softmax summed over a decode's tokens, equal to the full softmax copied from a twin
    context; the cells it reports seen are the sequence's, holes left by a removal excluded."""
    layers = [0, 29]
    toks = smollm2.tokenize(TEXT, add_special=True)
    ctxs = [Context(smollm2, n_ctx=256, n_batch=64, flash_attn="off", n_threads=2) for _ in range(2)]
    ctxs[0].capture.want("kq_soft_max", layers)
    ctxs[1].capture.want_sums("kq_soft_max", layers)
    with pytest.raises(EdgekvError, match="one way"):
        ctxs[1].capture.want("kq_soft_max", layers)

    def run(start: int, n: int) -> None:
        for ctx in ctxs:
            ctx.capture.clear()
            ctx.decode(toks[start : start + n], start)
        for il in layers:
            p = ctxs[0].capture.get("kq_soft_max", il)[0]  # [n_head, n, n_kv]
            sums, seen = ctxs[1].capture.column_sums("kq_soft_max", il)
            n_kv = p.shape[2]
            np.testing.assert_allclose(sums[:, :n_kv], p.sum(axis=1), rtol=1e-5, atol=1e-6)
            assert not sums[:, n_kv:].any()
            visible = np.flatnonzero(p[:, -1].sum(axis=0) > 0)  # the last token's row
            np.testing.assert_array_equal(seen, visible)
        assert seen.size == n_cells[0]

    n_cells = [0]
    for start in (0, 64, 128):
        n_cells[0] += 64
        run(start, 64)
        assert np.array_equal(ctxs[1].capture.column_sums("kq_soft_max", 0)[1], np.arange(start + 64))
    for ctx in ctxs:
        assert ctx.seq_rm(0, 20, 40)  # 20 cells freed in the middle
    n_cells[0] += 8 - 20
    run(192, 8)
    for ctx in ctxs:
        ctx.close()
