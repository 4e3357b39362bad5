"""Gemma 3 (iSWA: 15 sliding-window layers, 3 global ones) on the state engine.

The engine compresses only the global layers' cache and writes the
sliding-window cache back byte for byte. Evicting whole tokens that way must
give exactly what llama.cpp's own eviction (``llama_memory_seq_rm``) gives,
and a per-head selection must keep retrieval alive where it keeps the needle.
"""

from __future__ import annotations

import numpy as np
from _attention import captured_attention
from _helpers import prefill

from edgekv.bench.speed import long_text_tokens
from edgekv.kvcache import StateEngine
from edgekv.llama import Context


def _attention_after(eng: StateEngine, toks: list[int], start: int, layer: int) -> np.ndarray:
    eng.ctx.capture.clear()
    eng.decode(toks, start)
    q, out = captured_attention(eng.ctx, layer)
    return out


def test_iswa_compaction_equals_llama_cpp_eviction(gemma3) -> None:
    arch = gemma3.arch
    assert arch.n_swa == 512
    toks = long_text_tokens(gemma3, 704)
    n, probe = 700, toks[700:704]
    ctx = Context(gemma3, n_ctx=1024, n_batch=128, flash_attn="off", n_threads=2)
    ctx.capture.want("Qcur", [5])
    ctx.capture.want("kqv_out", [5])
    eng = StateEngine(ctx)
    assert eng.n_caches == 2
    prefill(eng, toks[:n])
    saved = eng.save()
    # drop tokens 4..153: for queries at 700+ they are outside the 512-token window, so
    # the sliding-window layers (which llama.cpp's seq_rm edits too) attend alike
    drop = np.arange(4, 154)
    assert ctx.seq_rm(0, int(drop[0]), int(drop[-1]) + 1)
    want = _attention_after(eng, probe, n, 5)

    eng.reset()
    eng.restore(saved)
    kept = np.setdiff1d(np.arange(n), drop)
    snap = eng.snapshot()
    assert snap.n_layer == 3  # the global layers 5, 11, 17
    eng.compact(np.broadcast_to(kept, (snap.n_layer, arch.n_head_kv, kept.size)).copy())
    assert eng.n_cells == kept.size
    got = _attention_after(eng, probe, n, 5)
    # layer 5 is the first global layer: everything before it is identical, so its
    # attention over the compacted cells equals llama.cpp's own up to summation order
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
    # and it is not trivially so: with the dropped tokens still present it differs
    eng.reset()
    eng.restore(saved)
    full = _attention_after(eng, probe, n, 5)
    assert np.abs(full - want).max() > 100 * np.abs(got - want).max()
    ctx.close()


def test_iswa_per_head_compaction_keeps_the_sliding_window_cache(gemma3) -> None:
    # a different token set per global layer: the sliding-window cache (positions,
    # K and V) is written back untouched and its positions stay the true ones
    toks = long_text_tokens(gemma3, 600)
    ctx = Context(gemma3, n_ctx=1024, n_batch=128, flash_attn="off", n_threads=2)
    eng = StateEngine(ctx)
    prefill(eng, toks)
    from edgekv.kvcache import layout

    before = layout.parse_seq_state(ctx.state_get(), n_caches=2, n_layers=None).sections[1]
    rng = np.random.default_rng(3)
    keep = np.stack([np.sort(np.concatenate([rng.choice(568, 268, replace=False), np.arange(568, 600)]))
                     for _ in range(3)])[:, None, :]
    eng.compact(keep)
    after = layout.parse_seq_state(ctx.state_get(), n_caches=2, n_layers=None)
    swa = after.sections[1]
    assert after.sections[0].n_cells == 300
    np.testing.assert_array_equal(np.sort(swa.pos), np.sort(before.pos))
    for a, b in zip(swa.layers, before.layers, strict=True):
        assert np.array_equal(np.asarray(a.k)[np.argsort(swa.pos)], np.asarray(b.k)[np.argsort(before.pos)])
    assert np.array_equal(eng.snapshot().token_pos[:, 0], keep[:, 0])
    ctx.close()


def test_iswa_merges_the_global_layers_and_keeps_the_sliding_window_cache(gemma3) -> None:
    """chelsea_nobias on Gemma 3: only the global layers' cells are merged (counts add up
    to every token there); the sliding-window cache comes back byte for byte; a session
    stays bounded and generates. chelsea (the log-count bias) is refused on this engine."""
    from edgekv.errors import EdgekvError
    from edgekv.kvcache import layout
    from edgekv.methods import get_method
    from edgekv.session import Session

    toks = long_text_tokens(gemma3, 600)
    ctx = Context(gemma3, n_ctx=1024, n_batch=128, flash_attn="off", n_threads=2)
    eng = StateEngine(ctx)
    prefill(eng, toks)
    swa = layout.parse_seq_state(ctx.state_get(), n_caches=2, n_layers=None).sections[1]
    get_method("chelsea_nobias").compress(eng, 300)
    after = layout.parse_seq_state(ctx.state_get(), n_caches=2, n_layers=None).sections[1]
    assert np.array_equal(after.pos, swa.pos)
    for a, b in zip(after.layers, swa.layers, strict=True):
        assert np.array_equal(a.k, b.k) and np.array_equal(a.v, b.v)
    snap = eng.snapshot()
    assert eng.n_cells == 300 and snap.n_layer == 3
    np.testing.assert_array_equal(snap.counts.sum(axis=2), np.full((3, 1), 600))
    ctx.close()
    with Session(gemma3, method="chelsea_nobias", budget=192, n_ctx=320, chunk=128, n_threads=2) as s:
        assert s.engine.name == "state"
        s.feed(long_text_tokens(gemma3, 900))
        assert s.stats.peak_cells <= 320 and s.stats.compressions >= 3
        assert "".join(s.generate(8)).strip()
        try:
            s.use("chelsea", budget=192)
            raise AssertionError("chelsea needs the log-count bias, which the state engine cannot apply")
        except EdgekvError as e:
            assert "bias" in str(e)
