"""Expected Attention: its score against the Gaussian expectation it stands for, the
query statistics the engines keep on the real model (the recorded queries rotated back,
carried by session files), the same cells on both engines, bounded memory on a prompt
four times the context, and a one-line refusal where RoPE is not reproduced.
(kvpress parity: tests/test_frontier_parity.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from edgekv import kernels
from edgekv.errors import EdgekvError
from edgekv.kvcache.rope import Rope
from edgekv.llama import cpu_flag
from edgekv.methods import base, expected_attention
from edgekv.methods.expected_attention import expected_attention_scores
from edgekv.session import Session

TEXT = ("The lighthouse keeper wrote down every ship that passed, its flag, its cargo and the hour. "
        "On stormy nights the entries grew short. The code of the harbour gate was 4417. ") * 6


def test_the_score_is_the_expected_attention_of_gaussian_queries() -> None:
    """exp(s k.mu + s^2 k^T S k / 2) is E[exp(s q.k)] for q ~ N(mu, S): checked by sampling
    the queries, softmaxing the averages over the cells, averaging the group."""
    rng = np.random.default_rng(3)
    n_head, n_kv, d, n = 4, 2, 8, 40
    mu = rng.standard_normal((n_head, d)) * 0.5
    a = rng.standard_normal((n_head, d, d)) * 0.3
    cov = a @ a.transpose(0, 2, 1)
    k = rng.standard_normal((n, n_kv, d)).astype(np.float32)
    scale = 1 / np.sqrt(d)
    got = expected_attention_scores(mu, cov, k, None, np.ones((n_kv, n), bool), scale)
    want = np.zeros((n_kv, n))
    for qh in range(n_head):
        q = rng.multivariate_normal(mu[qh], cov[qh], size=400_000)
        e = np.exp(scale * q @ k[:, qh // 2].astype(np.float64).T).mean(axis=0)  # E[exp(s q.k)] per cell
        want[qh // 2] += e / e.sum() / 2
    np.testing.assert_allclose(got, want, rtol=0.02)
    assert np.allclose(got.sum(axis=1), 1.0)


def _pre_rope(sess: Session) -> tuple[np.ndarray, np.ndarray]:
    """The window's queries rotated back by their positions: [rows, n_head, m, d], and the positions."""
    q, pos = sess.engine.window.last(sess.engine.window.size)
    rope = Rope.of(sess.model)
    return np.stack([rope.rotate(q[r], np.broadcast_to(-pos, q.shape[1:3])) for r in range(q.shape[0])]), pos


@pytest.mark.parametrize(("n", "d", "g"), [(1, 64, 3), (23, 64, 3), (24, 64, 3), (2500, 64, 3), (100, 33, 7),
                                         (49, 128, 2), (7, 5, 1), (0, 64, 3)])
def test_the_kernels_logits_are_the_float64_logits(n: int, d: int, g: int) -> None:
    # the mean term in double, the covariance term over the matrices' upper triangles in
    # float32, 24 keys and 3 matrices a tile: partial blocks of keys, a group of 7 (tiles of
    # 3, 3 and 1), head sizes off the 8-channel transposes; the matrices need not be
    # symmetric (C[i][j] + C[j][i] above the diagonal)
    from edgekv import kernels

    rng = np.random.default_rng(n + d + g)
    x = rng.standard_normal((n, d)).astype(np.float32)
    mu, mats, s = rng.standard_normal((g, d)), rng.standard_normal((g, d, d)), 0.125
    got = kernels.expected_logits(x, mu, mats, s)
    if not (cpu_flag("avx2") and cpu_flag("fma")):
        assert got is None  # numpy's products serve
        return
    x64 = x.astype(np.float64)
    lin, quad = mu @ x64.T, np.einsum("nd,gde,ne->gn", x64, mats, x64)
    # the mean term to double's rounding; the quadratic form's float32 sums of d (d + 1) / 2
    # products in two levels, to a few units of float32's epsilon times the sum of the
    # products' magnitudes
    quad_scale = np.einsum("nd,gde,ne->gn", np.abs(x64), np.abs(mats), np.abs(x64))
    lin_scale = np.abs(mu) @ np.abs(x64).T
    assert got.shape == (g, n) and got.dtype == np.float64
    err = np.abs(got - (s * lin + 0.5 * s**2 * quad))
    assert np.all(err <= 0.5 * s**2 * 8 * 2.0**-24 * np.sqrt(d) * quad_scale + s * d * 2.0**-52 * lin_scale)


def _random_layer(seed: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.random.Generator]:
    """A layer to score: 9 query heads' mean and covariance, n cells' float32 keys over 3 KV
    heads of 64 channels, every cell scored but 4 sinks; and the generator, for more."""
    rng = np.random.default_rng(seed)
    mu = rng.standard_normal((9, 64))
    a = rng.standard_normal((9, 64, 64)) / 64
    k = rng.standard_normal((n, 3, 64)).astype(np.float32)
    scored = np.ones((3, n), bool)
    scored[:, :4] = False
    return mu, a @ a.transpose(0, 2, 1), k, scored, rng


def test_the_kernel_scores_what_numpy_scores(monkeypatch) -> None:
    # the host kernel's covariance term and numpy's float32 products: the same scores to
    # float32's rounding of that term
    mu, cov, k, scored, _ = _random_layer(9, 3000)
    got = expected_attention_scores(mu, cov, k, None, scored, 0.125)
    monkeypatch.setattr(kernels, "expected_logits", lambda *a: None)
    want = expected_attention_scores(mu, cov, k, None, scored, 0.125)
    assert np.array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_scores_in_chunks_of_cells_are_the_one_pass_scores(monkeypatch) -> None:
    # numpy's path, where the host kernel cannot run: every sum runs over channels only, so
    # scoring 1024 cells at a time (to stay in cache) gives the whole layer's scores to
    # float32's rounding of the covariance term's products.
    # Not bit for bit on every CPU: OpenBLAS's AVX2 (Haswell) sgemm sums a row's products
    # in an order that depends on how many rows the product has (tested on an AMD EPYC
    # Zen 3: the first 1024 rows of a 2500-row product differ from a 1024-row one in the
    # last bits). 2500 cells: two full chunks and a partial one; a gap in one head's scored
    # cells takes the gather path
    monkeypatch.setattr(kernels, "expected_logits", lambda *a: None)
    n = 2500
    mu, cov, k, scored, rng = _random_layer(8, n)
    n_kv = k.shape[1]
    v = rng.standard_normal(k.shape).astype(np.float32)
    scored[1, 1500:1600] = False
    bias = np.log(rng.integers(1, 4, (n_kv, n))).astype(np.float64)
    got = expected_attention_scores(mu, cov, k, expected_attention.value_norms(v), scored, 0.125, bias)
    assert got.shape == (n_kv, n) and np.isinf(got[1, 1500:1600]).all() and np.isfinite(got[:, 4:1500]).all()
    monkeypatch.setattr(expected_attention, "CHUNK", n)  # the whole layer in one pass
    one_pass = expected_attention_scores(mu, cov, k, expected_attention.value_norms(v), scored, 0.125, bias)
    assert np.array_equal(np.isinf(got), np.isinf(one_pass))
    np.testing.assert_allclose(got, one_pass, rtol=1e-6)


@pytest.mark.parametrize("dv", [1, 7, 64, 72, 128, 200, 256, 576])
def test_value_norms_are_numpys_floats(dv: int) -> None:
    # the compiled pass must add the squares in numpy's pairwise order (eight partial sums per
    # block of 128, longer rows halved), or a norm moves in its last bit and a kept cell with it;
    # values spread over 2^-20 to 2^20, a strided view as the snapshot hands out
    rng = np.random.default_rng(dv)
    v = rng.standard_normal((1100, 6, dv)) * np.exp2(rng.uniform(-20, 20, (1100, 6, 1)))
    v = v.astype(np.float32)[:, ::2]
    want = np.linalg.norm(v.astype(np.float64), axis=2)
    assert expected_attention.value_norms(v).tobytes() == want.tobytes()


@pytest.mark.parametrize("engine", ["state", "native"])
def test_the_engine_keeps_the_statistics_of_the_unrotated_queries(smollm2_path, engine) -> None:
    """The moments after a chunked prefill equal the mean and covariance of every query the
    window also recorded, each rotated back by its own position, the first four left out."""
    with Session(smollm2_path, method="full", n_ctx=512, engine=engine, n_threads=2, chunk=64,
                 observe=512, moments=True) as s:
        s.feed_text(TEXT)
        n = s.engine.n_cells
        pre, pos = _pre_rope(s)
        assert pos.shape[0] == n and s.engine.moments.count == n - 4
        pre = pre[:, :, pos >= 4].astype(np.float64)
        for row in (0, 7, pre.shape[0] - 1):
            mu, cov = s.engine.moments.mean_cov(row)
            x = pre[row] - pre[row].mean(axis=1, keepdims=True)
            np.testing.assert_allclose(mu, pre[row].mean(axis=1), atol=1e-4)
            np.testing.assert_allclose(cov, x.transpose(0, 2, 1) @ x / x.shape[1], atol=1e-3, rtol=1e-4)


def test_both_engines_keep_the_same_cells(smollm2_path) -> None:
    kept = []
    for engine in ("state", "native"):
        with Session(smollm2_path, method="expected_attention", budget=160, n_ctx=420, engine=engine,
                     n_threads=2) as s:
            s.feed_text(TEXT)
            s.compress()
            state = s.engine.save()
            kept.append((state.blob, state.token_pos, int(np.argmax(s.logits()))))
    assert kept[0][0] == kept[1][0] and np.array_equal(kept[0][1], kept[1][1]) and kept[0][2] == kept[1][2]


@pytest.mark.parametrize("method", ["expected_attention", "protokv"])
def test_layers_read_and_scored_side_by_side_keep_the_same_cells(smollm2_path, method, monkeypatch) -> None:
    """The native snapshot reads layers for two scoring threads at once (its reads and the
    device's window scores serialised): the cells and the next token of one thread."""
    kept = []
    for threads in (1, 2):
        monkeypatch.setattr(base, "SCORE_THREADS", threads)
        with Session(smollm2_path, method=method, budget=160, n_ctx=420, engine="native", n_threads=2) as s:
            s.feed_text(TEXT)
            s.compress()
            state = s.engine.save()
            kept.append((state.blob, state.token_pos, int(np.argmax(s.logits()))))
    assert kept[0][0] == kept[1][0] and np.array_equal(kept[0][1], kept[1][1]) and kept[0][2] == kept[1][2]


def test_a_prompt_four_times_the_context_stays_within_its_cells(smollm2, smollm2_path) -> None:
    """The statistics cover every query seen (not only the cells still held) in fixed memory."""
    n_ctx, budget = 192, 96
    toks = smollm2.tokenize(TEXT * 4)[: 4 * n_ctx]
    assert len(toks) == 4 * n_ctx
    with Session(smollm2_path, method="expected_attention", budget=budget, n_ctx=n_ctx, n_threads=2) as s:
        peak = 0
        for i in range(0, len(toks), 96):
            s.feed(toks[i : i + 96])
            peak = max(peak, s.engine.n_cells)
        m = s.engine.moments
        assert peak <= n_ctx and s.stats.compressions >= 6
        assert m.count == len(toks) - 4 and m.outer.nbytes == m.total.nbytes * m.total.shape[2]
        assert all(t is not None for t in s.generate_tokens(4))


def test_the_statistics_survive_a_session_file(smollm2_path, tmp_path) -> None:
    """A conversation saved and resumed (the server's LRU, a restart) compresses as the live one."""
    path = tmp_path / "s.ekv"
    more = " Then the fog came in and the keeper lit the lamp early."

    def rest(s: Session) -> tuple[bytes, int]:
        s.feed_text(more)
        s.compress()
        return s.engine.save().blob, s.engine.moments.count

    with Session(smollm2_path, method="expected_attention", budget=160, n_ctx=420, n_threads=2) as s:
        s.feed_text(TEXT)
        s.save_file(path)
        saved = s.engine.moments.copy()
        live = rest(s)
    with Session(smollm2_path, method="expected_attention", budget=160, n_ctx=420, n_threads=2) as s:
        s.load_file(path)
        m = s.engine.moments
        assert m.count == saved.count and np.array_equal(m.total, saved.total)
        assert np.array_equal(m.outer, saved.outer)
        assert rest(s) == live


def test_a_model_whose_rope_is_not_reproduced_is_a_one_line_error(gemma3_path) -> None:
    """Gemma 3's sliding-window layers rotate with another base: refused before anything is cached."""
    with pytest.raises(EdgekvError, match="RoPE") as e:
        Session(gemma3_path, method="expected_attention", budget=160, n_ctx=420, n_threads=2)
    assert "\n" not in str(e.value) and "sliding-window" in str(e.value)
