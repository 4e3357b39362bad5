"""State engine on the real default model: bit-exact round trips, compaction
invariants, and refusal of bad state blobs without losing the cache."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import prefill

from edgekv.errors import EdgekvError, StateLayoutError
from edgekv.kvcache import CacheState, StateEngine, layout, quant
from edgekv.kvcache.snapshot import hadamard, unrotate
from edgekv.llama import Context

pytestmark = pytest.mark.kernels  # bit-exact logits after round trips through quantised caches

# (K type, V type, flash attention). A quantised V cache needs flash
# attention in llama.cpp, so "q8_0 with FA off" quantises K only.
CONFIGS = [("f16", "f16", "off"), ("f16", "f16", "on"), ("q8_0", "q8_0", "on"), ("q8_0", "f16", "off")]
IDS = [f"{k}-{v}-fa_{fa}" for k, v, fa in CONFIGS]
TEXT = ("In the harbour town the archivist kept a ledger of every ship. Each entry named the captain, "
        "the cargo and the day of arrival. ") * 12


def _ctx(model, ck: str, cv: str, fa: str, n_ctx: int = 512) -> tuple[Context, StateEngine]:
    ctx = Context(model, n_ctx=n_ctx, cache_type_k=ck, cache_type_v=cv, flash_attn=fa, n_threads=2)
    return ctx, StateEngine(ctx)


def _next_logits(ctx: Context, eng: StateEngine, tok: int) -> np.ndarray:
    eng.decode([tok], ctx.pos_max() + 1)
    return ctx.logits()


@pytest.fixture(scope="module")
def toks(smollm2) -> list[int]:
    return smollm2.tokenize(TEXT)


@pytest.mark.parametrize(("ck", "cv", "fa"), CONFIGS, ids=IDS)
def test_untouched_roundtrip_and_keep_all_are_bit_identical(smollm2, toks, ck, cv, fa) -> None:
    ctx, eng = _ctx(smollm2, ck, cv, fa)
    body, last = toks[:-1], toks[-1]
    prefill(eng, body)
    ref = _next_logits(ctx, eng, last)

    prefill(eng, body)
    blob = ctx.state_get()
    st = layout.parse_seq_state(blob, n_caches=1, n_layers=[smollm2.arch.n_layer])
    assert st.sections[0].v_trans == (fa == "off")
    rebuilt = layout.write_seq_state(st)
    assert rebuilt == blob
    ctx.state_set(rebuilt)
    assert np.array_equal(_next_logits(ctx, eng, last), ref)

    prefill(eng, body)
    n = eng.n_cells
    eng.compact(np.broadcast_to(np.arange(n), (smollm2.arch.n_layer, smollm2.arch.n_head_kv, n)))
    assert np.array_equal(_next_logits(ctx, eng, last), ref)
    ctx.close()


@pytest.mark.parametrize(("ck", "cv", "fa"), CONFIGS, ids=IDS)
def test_compaction_invariants(smollm2, toks, ck, cv, fa) -> None:
    ctx, eng = _ctx(smollm2, ck, cv, fa)
    prefill(eng, toks)
    n = eng.n_cells
    pos_max = ctx.pos_max()
    before = eng.snapshot()
    rng = np.random.default_rng(7)
    budget = 64
    L, H = smollm2.arch.n_layer, smollm2.arch.n_head_kv
    keep = np.empty((L, H, budget), dtype=np.int64)
    for il in range(L):
        for h in range(H):
            keep[il, h] = np.sort(np.concatenate([rng.choice(n - 1, budget - 1, replace=False), [n - 1]]))
    eng.compact(keep)

    # llama.cpp's own view: the blob holds exactly `budget` cells; pos_max unchanged.
    sec = layout.parse_seq_state(ctx.state_get(), n_caches=1, n_layers=[L]).sections[0]
    assert sec.n_cells == budget == eng.n_cells
    assert ctx.pos_max() == pos_max
    assert np.all(np.diff(np.sort(sec.pos)) > 0)

    after = eng.snapshot()
    for il in range(L):
        for h in range(H):
            np.testing.assert_array_equal(after.keys(il)[:, h], before.keys(il)[keep[il, h], h])
            np.testing.assert_array_equal(after.values(il)[:, h], before.values(il)[keep[il, h], h])
            np.testing.assert_array_equal(after.token_pos[il, h], before.token_pos[il, h][keep[il, h]])

    # Decoding continues at pos_max + 1 and appends one cell.
    tok = smollm2.tokenize(" ledger", add_special=False)[0]
    logits = _next_logits(ctx, eng, tok)
    assert np.isfinite(logits).all()
    assert ctx.pos_max() == pos_max + 1
    assert layout.parse_seq_state(ctx.state_get(), n_caches=1, n_layers=[L]).sections[0].n_cells == budget + 1
    ctx.close()


def test_bad_keep_indices_are_refused_and_cache_kept(smollm2, toks) -> None:
    ctx, eng = _ctx(smollm2, "f16", "f16", "on")
    prefill(eng, toks[:100])
    blob = ctx.state_get()
    L, H = smollm2.arch.n_layer, smollm2.arch.n_head_kv
    bad = [
        np.zeros((L, H, 3), dtype=np.int64),  # not strictly increasing
        np.broadcast_to(np.arange(10), (L, H, 10)),  # drops the newest cell
        np.broadcast_to(np.arange(90, 101), (L, H, 11)),  # out of range
        np.broadcast_to(np.arange(100), (L, 1, 100)),  # wrong head count
    ]
    for keep in bad:
        with pytest.raises(EdgekvError):
            eng.compact(keep)
        assert ctx.state_get() == blob and eng.n_cells == 100
    ctx.close()


def test_wrong_state_blobs_are_refused_without_loss(smollm2, toks) -> None:
    ctx, eng = _ctx(smollm2, "f16", "f16", "on")
    prefill(eng, toks[:100])
    good = eng.save()
    q8ctx, q8eng = _ctx(smollm2, "q8_0", "q8_0", "on")
    prefill(q8eng, toks[:100])
    other = q8eng.save()
    corrupt = [
        CacheState(blob=b"\x00" * 64, token_pos=good.token_pos, engine="state"),
        CacheState(blob=good.blob[: len(good.blob) // 2], token_pos=good.token_pos, engine="state"),
        CacheState(blob=good.blob + b"\x01\x02\x03\x04", token_pos=good.token_pos, engine="state"),
        CacheState(blob=good.blob, token_pos=good.token_pos[:, :, :10], engine="state"),
        other,  # q8_0 cache into an f16 context: llama.cpp refuses the K type
    ]
    for st in corrupt:
        with pytest.raises((StateLayoutError, EdgekvError)):
            eng.restore(st)
    # What failed before reaching llama.cpp left the cache alone; a llama.cpp
    # refusal clears the sequence, so the saved state must restore cleanly.
    eng.restore(good)
    assert ctx.state_get() == good.blob
    ctx.close()
    q8ctx.close()


@pytest.mark.parametrize("block", [64, 128])
def test_unrotate_is_the_exact_product_rounded_once(block: int) -> None:
    """unrotate computes x @ H with sums that are exact here (float32 rows; q8_0 rows hold
    fewer bits still), so it must equal the float64 product, in any order BLAS adds it,
    scaled and rounded once: one answer on every CPU, which the native lag kernel gives too."""
    rng = np.random.default_rng(block)
    x = rng.standard_normal((257, 3 * block)).astype(np.float32)  # 257: a partial tile of rows
    q8 = quant.type_by_name("q8_0").id
    x[5] = quant.dequantize(quant.quantize(x[5:6], q8), q8, 3 * block)[0]  # a q8_0 row
    signs = np.sign(hadamard(block)).astype(np.float64)
    exact = (x.reshape(-1, block).astype(np.float64) @ signs) * (1.0 / np.sqrt(np.float64(block)))
    got = unrotate(x, block)
    assert got.dtype == np.float32 and got.shape == x.shape
    assert np.array_equal(got, exact.astype(np.float32).reshape(x.shape))
    assert np.allclose(got, (x.reshape(-1, block) @ hadamard(block)).reshape(x.shape), atol=1e-5)
    assert np.allclose(unrotate(got, block), x, atol=1e-5)  # H is its own inverse
    assert np.array_equal(unrotate(x.T.copy().T, block), got)  # any memory layout
    assert unrotate(x, 0) is x


def test_quantised_cache_snapshot_undoes_hadamard_rotation(smollm2, toks) -> None:
    """llama.cpp stores quantised K/V Hadamard-rotated; snapshots must show the
    model's own keys, so a q8_0 snapshot matches an f16 one up to q8_0 error
    (a rotated read would differ by about the keys' own magnitude)."""
    snaps = {}
    for ct in ("f16", "q8_0"):
        ctx, eng = _ctx(smollm2, ct, ct, "on")
        assert (ctx.k_rot, ctx.v_rot) == ((64, 64) if ct == "q8_0" else (0, 0))
        prefill(eng, toks[:200])
        snaps[ct] = eng.snapshot()
        snaps[ct].keys(0), snaps[ct].values(0)
        ctx.close()
    for get in ("keys", "values"):
        a, b = getattr(snaps["f16"], get)(0), getattr(snaps["q8_0"], get)(0)
        rel = np.abs(a - b).mean() / np.abs(a).mean()
        assert rel < 0.02, f"{get}: relative error {rel:.3f}"
