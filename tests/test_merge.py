"""Merging cells on the real default model, both engines: merged rows are the
count-weighted means of what they absorbed, re-quantised in the cache's type;
counts add up over successive merges and survive save/restore and session
files; the native engine's device merge (with the log-count bias) writes the
same bytes as the state engine's host merge; Chelsea runs in sessions."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import prefill

from edgekv.errors import EdgekvError
from edgekv.kvcache import StateEngine
from edgekv.kvcache.native import NativeEngine
from edgekv.llama import Context
from edgekv.session import Session

pytestmark = pytest.mark.kernels  # merged rows re-quantised and the attention that weighs them

TEXT = " ".join(f"Entry {i}: the cart from {['Leeds', 'York', 'Bath'][i % 3]} brought {i * 7} sacks of flour."
                for i in range(80))
# (cache type, flash attention): f16 with a transposed V, and a quantised, Hadamard-rotated q8_0
CONFIGS = [("f16", "off"), ("q8_0", "on")]


@pytest.fixture(scope="module")
def toks(smollm2) -> list[int]:
    return smollm2.tokenize(TEXT)[:320]


def _ctx(model, ct: str, fa: str) -> Context:
    return Context(model, n_ctx=512, cache_type_k=ct, cache_type_v=ct, flash_attn=fa, n_threads=2)


def _plan(rng: np.random.Generator, L: int, H: int, n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """m random (source, destination) pairs per (layer, head) among the first n - 8 cells;
    several sources share a destination."""
    src = np.empty((L, H, m), np.int64)
    dst = np.empty((L, H, m), np.int64)
    for li in range(L):
        for h in range(H):
            cells = rng.permutation(n - 8)
            src[li, h] = cells[:m]
            dst[li, h] = rng.choice(cells[m : m + m // 3], m)
    return src, dst


def _tolerance(ct: str, ref: np.ndarray) -> float:
    """One rounding of the cache type: f16's half ulp, or a q8_0 step of the largest block."""
    return float(np.abs(ref).max()) * (1e-3 if ct == "f16" else 1.5 / 127)


@pytest.mark.parametrize(("ct", "fa"), CONFIGS)
def test_state_merge_writes_count_weighted_means_and_counts_add_up(smollm2, toks, ct, fa) -> None:
    ctx = _ctx(smollm2, ct, fa)
    eng = StateEngine(ctx)
    L, H = smollm2.arch.n_layer, smollm2.arch.n_head_kv
    prefill(eng, toks)
    n = eng.n_cells
    before = eng.snapshot()
    orig = {li: (before.keys(li).copy(), before.values(li).copy()) for li in (0, L // 2, L - 1)}
    rng = np.random.default_rng(1)
    absorbed = [[{i: {i} for i in range(n)} for _ in range(H)] for _ in range(L)]
    for rnd in range(2):  # the second merge folds centroids into centroids
        cur = eng.snapshot()
        src, dst = _plan(rng, L, H, cur.n_cells, 40)
        tp = cur.token_pos
        for li in range(L):
            for h in range(H):
                for s, d in zip(src[li, h], dst[li, h], strict=True):
                    absorbed[li][h][int(tp[li, h, d])] |= absorbed[li][h].pop(int(tp[li, h, s]))
        eng.merge(src, dst, bias=False)
        assert eng.n_cells == n - 40 * (rnd + 1)
    after = eng.snapshot()
    assert after.counts is not None and not after.bias
    for li, (k0, v0) in orig.items():
        for h in range(H):
            tp = after.token_pos[li, h]
            assert np.all(np.diff(tp) > 0)
            assert sorted(absorbed[li][h]) == tp.tolist()  # sources gone, survivors in order
            for j, t in enumerate(tp):
                members = sorted(absorbed[li][h][int(t)])
                assert after.counts[li, h, j] == len(members)
                if len(members) > 1:  # a centroid: the plain mean of every token it absorbed
                    for got, ref in ((after.keys(li)[j, h], k0[members, h]), (after.values(li)[j, h], v0[members, h])):
                        assert np.abs(got - ref.mean(axis=0)).max() <= 2 * _tolerance(ct, ref)
                else:
                    np.testing.assert_array_equal(after.keys(li)[j, h], k0[t, h])
    assert after.counts.sum(axis=2).min() == n
    eng.decode([toks[3]], ctx.pos_max() + 1)  # decoding goes on; the new cell counts once
    assert eng.snapshot().counts[:, :, -1].tolist() == np.ones((L, H)).tolist()
    ctx.close()


@pytest.mark.parametrize(("ct", "fa"), [("f16", "off"), ("f16", "on"), ("q8_0", "on")])
def test_native_device_merge_writes_what_the_state_engine_writes(smollm2, toks, ct, fa) -> None:
    L, H = smollm2.arch.n_layer, smollm2.arch.n_head_kv
    caches, counts = {}, {}
    for name in ("state", "native"):
        ctx = _ctx(smollm2, ct, fa)
        eng = StateEngine(ctx) if name == "state" else NativeEngine(ctx)
        prefill(eng, toks)
        rng = np.random.default_rng(7)
        for _ in range(2):
            src, dst = _plan(rng, L, H, eng.n_cells, 30)
            eng.merge(src, dst, bias=name == "native")
        snap = eng.snapshot()
        caches[name] = (ctx.state_get(), [snap.keys(li).copy() for li in range(L)])
        counts[name] = snap.counts
        if name == "native":
            assert snap.bias
            np.testing.assert_allclose(eng.bias_get(), np.log(snap.counts), atol=1e-6)
        ctx.close()
    np.testing.assert_array_equal(counts["state"], counts["native"])
    if ct == "f16":
        # the same float32 arithmetic and the same rounding: identical bytes
        assert caches["state"][0] == caches["native"][0]
    else:
        # ggml's AVX q8_0 quantiser rounds half to even and scales by 127/amax: a rare block is one step off
        for a, b in zip(caches["state"][1], caches["native"][1], strict=True):
            assert np.abs(a - b).max() <= _tolerance(ct, a)
            assert np.mean(a != b) < 1e-3


@pytest.mark.parametrize("graph", [False, True], ids=["host", "graph"])
@pytest.mark.parametrize(("ct", "fa"), [("q8_0", "on"), ("q4_0", "on"), ("f16", "off")])
def test_native_unbiased_merge_writes_the_state_engines_bytes(smollm2, toks, ct, fa, graph, monkeypatch) -> None:
    """Without the bias the native engine rounds as the state engine does (ggml's reference
    quantisers): the same blob after two merges. A cache in host memory merges in place;
    the graph (``EDGEKV_GRAPH_OPS=1``), which rounds a quantised cache like set_rows, hands
    a quantised cache's merge to the state engine, and so writes the same bytes too."""
    if graph:
        monkeypatch.setenv("EDGEKV_GRAPH_OPS", "1")
    L, H = smollm2.arch.n_layer, smollm2.arch.n_head_kv
    blobs, counts, host_merges = {}, {}, []
    real_merge = StateEngine.merge

    def counted(self, *a, **k) -> None:
        host_merges.append(self)
        real_merge(self, *a, **k)

    monkeypatch.setattr(StateEngine, "merge", counted)
    for name in ("state", "native"):
        ctx = _ctx(smollm2, ct, fa)
        eng = StateEngine(ctx) if name == "state" else NativeEngine(ctx)
        host_merges.clear()
        prefill(eng, toks)
        rng = np.random.default_rng(11)
        for _ in range(2):
            eng.merge(*_plan(rng, L, H, eng.n_cells, 30), bias=False)
        snap = eng.snapshot()
        blobs[name], counts[name] = ctx.state_get(), snap.counts
        assert not snap.bias
        if name == "native":
            assert not np.any(eng.bias_get())
            assert len(host_merges) == (2 if graph and ct != "f16" else 0)  # which path merged
        ctx.close()
    np.testing.assert_array_equal(counts["state"], counts["native"])
    assert blobs["state"] == blobs["native"]


@pytest.mark.parametrize("engine", ["native", "state"])
def test_counts_survive_save_restore_and_session_files(smollm2, tmp_path, engine) -> None:
    method = "chelsea" if engine == "native" else "chelsea_nobias"
    text = TEXT * 2
    with Session(smollm2, method=method, budget=160, n_ctx=288, chunk=128, engine=engine, n_threads=2) as s:
        s.feed_text(text)
        assert s.stats.compressions >= 2
        snap = s.engine.snapshot()
        assert snap.counts is not None and snap.counts.max() > 2 and snap.bias == (engine == "native")
        np.testing.assert_array_equal(snap.counts.sum(axis=2), np.full(snap.counts.shape[:2], s.n_past))
        saved = s.save()
        s.feed_text(" More entries follow.")
        s.restore(saved)
        np.testing.assert_array_equal(s.engine.snapshot().counts, snap.counts)
        f = tmp_path / "merged.ekv"
        s.save_file(f)
        s.feed_text(" The cart from")
        want = s.logits()
    with Session(smollm2, method=method, budget=160, n_ctx=288, engine=engine, n_threads=2) as s2:
        s2.load_file(f)
        got = s2.engine.snapshot()
        np.testing.assert_array_equal(got.counts, snap.counts)
        assert got.bias == snap.bias
        if engine == "native":
            np.testing.assert_allclose(s2.engine.bias_get(), np.log(snap.counts), atol=1e-6)
        s2.feed_text(" The cart from")
        np.testing.assert_array_equal(s2.logits(), want)  # the bias, or its absence, came back too
    if engine == "native":
        # attention cannot weigh the counts on the state engine: refused, nothing lost
        with Session(smollm2, method="chelsea_nobias", budget=160, n_ctx=288, engine="state", n_threads=2) as s3:
            s3.feed_text("Hello")
            with pytest.raises(EdgekvError, match="native engine") as e:
                s3.load_file(f)
            assert "\n" not in str(e.value) and s3.engine.n_cells == s3.n_past


def test_chelsea_is_refused_where_attention_cannot_weigh_counts(smollm2) -> None:
    with Session(smollm2, method="full", n_ctx=128, engine="state", n_threads=2) as s:
        with pytest.raises(EdgekvError, match="bias") as e:
            s.use("chelsea", budget=100)
        assert "\n" not in str(e.value)
        s.use("chelsea_nobias", budget=100)  # the same merges, unbiased, run anywhere


def test_native_bias_follows_biased_and_unbiased_merges(smollm2, toks) -> None:
    """A host merge (no bias) zeroes the device bias but keeps the counts; a biased merge
    after it weighs every cell by its count again. Context shift refuses merged caches."""
    ctx = _ctx(smollm2, "f16", "on")
    eng = NativeEngine(ctx)
    L, H = smollm2.arch.n_layer, smollm2.arch.n_head_kv
    prefill(eng, toks)
    rng = np.random.default_rng(3)
    for bias in (True, False, True):
        eng.merge(*_plan(rng, L, H, eng.n_cells, 20), bias=bias)
        snap = eng.snapshot()
        assert snap.bias == bias and snap.counts.sum(axis=2).min() == len(toks)
        np.testing.assert_allclose(eng.bias_get(), np.log(snap.counts) if bias else 0.0, atol=1e-6)
    with pytest.raises(EdgekvError, match="unmerged"):
        eng.shift(4, 8)
    ctx.close()
