"""KVzip: its scoring step against a direct reading of its definition and against the
form of kvpress's ``score_kvzip``, and the reconstruction pass on the real model
(rolled back byte for byte, the same cells on both engines, bounded memory on a
prompt four times the context, token ids carried by session files)."""

from __future__ import annotations

import numpy as np
import pytest

from edgekv.errors import EdgekvError
from edgekv.methods import get_method
from edgekv.methods.kvzip import KVzip, reconstruction_scores
from edgekv.session import Session

TEXT = ("The lighthouse keeper wrote down every ship that passed, its flag, its cargo and the hour. "
        "On stormy nights the entries grew short. The code of the harbour gate was 4417. ") * 6


def _brute(q, q_pos, k, cell_pos, token_pos, first_repeat, sinks, lo, hi, scale):
    """The definition, one (KV head, query head, query) at a time."""
    n_head, m, _ = q.shape
    n, n_kv, _ = k.shape
    group = n_head // n_kv
    out = np.zeros((n_kv, n))
    for h in range(n_kv):
        rep = cell_pos >= first_repeat
        chunk = ~rep & (token_pos[h] >= lo) & (token_pos[h] < hi)
        for qh in range(h * group, (h + 1) * group):
            for j in range(m):
                seen = [c for c in range(n) if (not rep[c] and token_pos[h, c] < sinks) or chunk[c]
                        or (rep[c] and cell_pos[c] <= q_pos[j])]
                logits = np.array([scale * float(q[qh, j] @ k[c, h]) for c in seen])
                p = np.exp(logits - logits.max())
                p /= p.sum()
                for c, pc in zip(seen, p, strict=True):
                    if chunk[c]:
                        out[h, c] = max(out[h, c], pc)
    return out


def test_scores_follow_the_definition_on_a_per_head_cache() -> None:
    # 40 context cells holding different tokens per head (a compacted cache), then 12 repeat cells
    rng = np.random.default_rng(4)
    n_ctx, m, n_head, n_kv, d = 40, 12, 6, 2, 8
    token_pos = np.stack([np.sort(rng.choice(120, n_ctx, replace=False)) for _ in range(n_kv)])
    token_pos[:, :3] = [0, 1, 2]  # sinks
    cell_pos = np.concatenate([token_pos.min(axis=0), 200 + np.arange(m)])
    token_pos = np.concatenate([token_pos, np.broadcast_to(200 + np.arange(m), (n_kv, m))], axis=1)
    k = rng.standard_normal((n_ctx + m, n_kv, d))
    q = rng.standard_normal((n_head, m, d))
    q_pos = 200 + np.arange(m)
    got = reconstruction_scores(q, q_pos, k, cell_pos, token_pos, 200, 4, 30, 80, 0.35)
    want = _brute(q, q_pos, k, cell_pos, token_pos, 200, 4, 30, 80, 0.35)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    chunk = (token_pos >= 30) & (token_pos < 80) & (cell_pos < 200)
    assert (got[chunk] > 0).all() and (got[~chunk] == 0).all()


def test_the_repeat_covers_what_most_heads_hold_within_its_span() -> None:
    rng = np.random.default_rng(2)
    token_pos = np.stack([np.sort(rng.choice(400, 100, replace=False)) for _ in range(12)]).reshape(4, 3, 100)
    token_pos[..., :4] = np.arange(4)  # sinks, held everywhere
    token_pos[..., 4] = 399  # held everywhere
    for span, most in ((1.0, 100), (0.5, 50), (10.0, None)):
        rep = KVzip(span=span).to_repeat(token_pos)
        held, holders = np.unique(token_pos, return_counts=True)
        if most is None:  # a span past the union repeats all of it
            assert np.array_equal(rep, held)
            continue
        assert len(rep) == most and np.all(np.diff(rep) > 0) and {0, 1, 2, 3, 399} <= set(rep.tolist())
        left_out = np.setdiff1d(held, rep)
        assert holders[np.isin(held, rep)].min() >= holders[np.isin(held, left_out)].max()


def test_scores_equal_kvpress_form_on_a_whole_cache() -> None:
    # kvpress's score_kvzip: keys [sinks, chunk, repeat] concatenated, a causal mask on the
    # repeat block, softmax, the chunk's columns, max over the GQA group and the queries
    rng = np.random.default_rng(7)
    n_ctx, m, n_head, n_kv, d, sink, lo, hi = 64, 10, 8, 2, 16, 4, 20, 50
    k = rng.standard_normal((n_ctx + m, n_kv, d)).astype(np.float32)
    q = rng.standard_normal((n_head, m, d)).astype(np.float32)
    pos = np.arange(n_ctx + m)
    token_pos = np.broadcast_to(pos, (n_kv, n_ctx + m))
    got = reconstruction_scores(q, pos[n_ctx:], k, pos, token_pos, n_ctx, sink, lo, hi, 1 / np.sqrt(d))

    kk = np.concatenate([k[:sink], k[lo:hi], k[n_ctx:]])  # [c, n_kv, d]
    qq = q.reshape(n_kv, n_head // n_kv, m, d).astype(np.float64)
    w = np.einsum("hgqd,chd->hgqc", qq, kk.astype(np.float64)) / np.sqrt(d)
    w[..., -m:] += np.triu(np.full((m, m), -np.inf), 1)
    w = np.exp(w - w.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    want = w[..., sink : sink + hi - lo].max(axis=(1, 2))  # [n_kv, hi - lo]
    np.testing.assert_allclose(got[:, lo:hi], want, rtol=1e-6)
    assert (got[:, :lo] == 0).all() and (got[:, hi:] == 0).all()


@pytest.mark.parametrize("engine", ["state", "native"])
def test_the_reconstruction_pass_leaves_the_cache_as_it_was(smollm2_path, engine) -> None:
    with Session(smollm2_path, method="kvzip", budget=160, n_ctx=420, engine=engine, n_threads=2,
                 method_params={"chunk": 64}) as s:
        s.feed_text(TEXT)
        n = s.engine.n_cells
        assert 160 < n <= 420
        before = s.engine.save()
        scores, token_pos = s.method.reconstruct(s.engine)
        after = s.engine.save()
        assert after.blob == before.blob and np.array_equal(after.token_pos, before.token_pos)
        assert np.array_equal(after.ids, before.ids) and s.engine.n_cells == n
        assert scores.shape == token_pos.shape == (s.model.arch.n_layer, s.model.arch.n_head_kv, n)
        assert (scores[token_pos < 4] == 1).all()
        assert ((scores >= 0) & (scores <= 1)).all() and (scores[token_pos >= 4] < 1).any()
        logits = s.logits().copy()
        s.feed(s.model.tokenize(" The code", add_special=False))  # decoding goes on as if nothing happened
        assert np.isfinite(s.logits()).all() and not np.array_equal(s.logits(), logits)


def test_both_engines_keep_the_same_cells(smollm2_path) -> None:
    kept = []
    for engine in ("state", "native"):
        with Session(smollm2_path, method="kvzip", budget=160, n_ctx=420, engine=engine, n_threads=2,
                     method_params={"chunk": 64}) as s:
            s.feed_text(TEXT)
            s.compress()
            kept.append((s.engine.save().blob, s.engine.save().token_pos))
    assert kept[0][0] == kept[1][0] and np.array_equal(kept[0][1], kept[1][1])


def test_a_prompt_four_times_the_context_stays_within_its_cells(smollm2, smollm2_path) -> None:
    n_ctx, budget = 192, 96
    toks = smollm2.tokenize(TEXT * 4)[: 4 * n_ctx]
    assert len(toks) == 4 * n_ctx
    with Session(smollm2_path, method="kvzip", budget=budget, n_ctx=n_ctx, n_threads=2,
                 method_params={"chunk": 64}) as s:
        assert s.stats.scratch_cells == KVzip(chunk=64).scratch_cells
        assert s.ctx.n_ctx <= n_ctx + s.stats.scratch_cells + 255  # llama.cpp rounds up to 256
        peak = 0
        for i in range(0, len(toks), 96):
            s.feed(toks[i : i + 96])
            peak = max(peak, s.engine.n_cells)
        assert peak <= n_ctx and s.stats.compressions >= 6
        assert (s.engine.tokens.token_ids(np.unique(s.engine.snapshot().token_pos)) >= 0).all()
        assert s.stats.kv_bytes_allocated == (n_ctx + s.stats.scratch_cells) * s.stats.kv_bytes_per_cell
        assert all(t is not None for t in s.generate_tokens(4))


def test_token_ids_survive_a_session_file_and_kvzip_runs_after_it(smollm2_path, tmp_path) -> None:
    path = tmp_path / "s.ekv"
    with Session(smollm2_path, method="kvzip", budget=160, n_ctx=420, n_threads=2,
                 method_params={"chunk": 64}) as s:
        s.feed_text(TEXT)
        ids = s.engine.tokens.ids.copy()
        s.save_file(path)
    with Session(smollm2_path, method="kvzip", budget=160, n_ctx=420, n_threads=2,
                 method_params={"chunk": 64}) as s:
        s.load_file(path)
        assert np.array_equal(s.engine.tokens.ids, ids)
        s.compress()
        assert s.engine.n_cells == 160
        s.engine.tokens.ids[:] = -1  # a cache whose text is unknown (a file written without it)
        s.feed(s.model.tokenize(" more words here", add_special=False))
        with pytest.raises(EdgekvError, match="token ids are unknown"):
            s.compress(100)


def test_kvzip_without_room_to_repeat_is_a_one_line_error(smollm2, smollm2_path) -> None:
    toks = smollm2.tokenize(TEXT * 3)[:500]
    with Session(smollm2_path, method="full", n_ctx=512, n_threads=2) as s:
        s.feed(toks)
        assert s.ctx.n_ctx - s.engine.n_cells < 20
        s.use("kvzip", budget=100)  # the context was made for full: no scratch cells
        with pytest.raises(EdgekvError, match="free cells") as e:
            s.compress()
        assert "\n" not in str(e.value) and s.engine.n_cells == 500  # nothing lost
    with pytest.raises(EdgekvError, match="chunk"):
        get_method("kvzip", chunk=4)


def test_kvzip_under_the_chunk_wrapper_scores_from_its_reconstruction(smollm2_path) -> None:
    """+chunk keeps KVzip's runs: the wrapper's selection reads the snapshot KVzip's pass made."""
    kept = []
    for name in ("kvzip", "kvzip+chunk@8"):
        with Session(smollm2_path, method=name, budget=160, n_ctx=420, n_threads=2,
                     method_params={"chunk": 64}) as s:
            s.feed_text(TEXT)
            s.compress()
            assert s.engine.n_cells == 160
            kept.append(s.engine.snapshot().token_pos)
    assert not np.array_equal(kept[0], kept[1])
    runs = np.diff(kept[1], axis=2) == 1  # consecutive tokens: whole runs are kept
    assert runs.mean() > np.mean(np.diff(kept[0], axis=2) == 1)
