"""Attention with the log-count bias, checked where llama.cpp computes it.

The eval-callback capture (native/capture.c) copies each layer's post-RoPE
queries (``Qcur-<il>``) and attention output (``kqv_out-<il>``) while
llama_decode runs. A float64 numpy attention over the cache's own K, V,
positions and bias must reproduce that output on every kernel path the CPU
backend picks at run time:

- ``softmax``: flash attention off (``ggml_soft_max_ext`` then ``mul_mat`` with V);
- ``one_chunk``: flash attention's default loop (a few queries, or a quantised cache);
- ``tiled``: flash attention with 64+ queries and K, V of one float type;
- ``split_kv``: flash attention for one query over 512+ cells (n_kv is padded
  to 256, so 300 used cells give 512), K and V of one float type.

The reference is the attention the bias is meant to give; the kernels round
(Q and the probabilities to f16, an f16 V accumulator on the one-chunk path),
so the check is relative to the output's scale, and a reference computed
without the bias must miss by far more: a bias that did not reach the
kernel fails on every CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from _attention import captured_attention, reference_attention
from _helpers import prefill

from edgekv.capture import available as capture_available
from edgekv.kvcache.native import NativeEngine
from edgekv.llama import Context

pytestmark = pytest.mark.kernels  # attention computed by llama.cpp's kernels

TEXT = ("The lighthouse keeper wrote down every ship that passed, its flag, its cargo and the hour. "
        "On stormy nights the entries grew short. ") * 20

# (path, K type, V type, flash attention, cells before, queries decoded together)
CASES = [
    ("softmax", "f16", "f16", "off", 200, 4),
    ("softmax", "q8_0", "f16", "off", 200, 4),
    ("one_chunk", "f16", "f16", "on", 200, 4),
    ("one_chunk", "q8_0", "q8_0", "on", 200, 4),
    ("one_chunk", "q8_0", "q8_0", "on", 300, 1),  # quantised: never split, even over 512 cells
    ("tiled", "f16", "f16", "on", 150, 80),
    ("split_kv", "f16", "f16", "on", 300, 1),
]
IDS = [f"{p}-{k}-{v}-fa_{fa}-{n}+{q}" for p, k, v, fa, n, q in CASES]
LAYERS = (0, 13, 29)


def test_capture_module_is_built() -> None:
    # setup.sh builds it against any libggml; without it the attention checks below cannot run
    assert capture_available()


@pytest.mark.parametrize(("path", "ck", "cv", "fa", "n0", "n_q"), CASES, ids=IDS)
def test_attention_with_bias_equals_float64_reference(smollm2, path, ck, cv, fa, n0, n_q) -> None:
    arch = smollm2.arch
    ctx = Context(smollm2, n_ctx=512, n_batch=128, cache_type_k=ck, cache_type_v=cv, flash_attn=fa, n_threads=2)
    assert ctx.flash_attn == fa
    eng = NativeEngine(ctx)
    toks = smollm2.tokenize(TEXT)
    assert len(toks) >= n0 + n_q
    prefill(eng, toks[:n0])
    eng.bias_enable()
    rng = np.random.default_rng(7)
    bias = rng.uniform(0.0, 4.0, (arch.n_layer, arch.n_head_kv, eng.n_cells)).astype(np.float32)
    eng.bias_set(bias)

    cap = ctx.capture
    cap.want("Qcur", LAYERS)
    cap.want("kqv_out", LAYERS)
    cap.clear()
    eng.decode(toks[n0 : n0 + n_q], n0)

    snap = eng.snapshot()  # K/V of every cell, the new queries' own included, unrotated
    full_bias = eng.bias_get()
    np.testing.assert_array_equal(full_bias[..., :n0], bias)  # new cells count once: zero bias
    assert not full_bias[..., n0:].any()
    q_pos = np.arange(n0, n0 + n_q)
    scale = 1.0 / np.sqrt(arch.head_dim_k)
    for il in LAYERS:
        q, out = captured_attention(ctx, il)
        assert q.shape == (n_q, arch.n_head, arch.head_dim_k)
        k, v = snap.keys(il), snap.values(il)
        ref = reference_attention(q, k, v, full_bias[il], q_pos, snap.pos, scale)
        plain = reference_attention(q, k, v, None, q_pos, snap.pos, scale)
        err = np.abs(out - ref)
        miss = np.abs(plain - ref).mean()
        # The kernels round Q to the K cache's dot-product type (f16, or q8_0 blocks for
        # a q8_0 K), the probabilities or the V accumulator to f16: up to 3 % of the
        # output's scale measured (q8_0), 1 % (f16). A bias that did not reach the kernel
        # would miss by as much as the unbiased reference does.
        assert err.max() < 0.06 * np.abs(ref).max(), f"layer {il}: max |kernel - reference| = {err.max():.4g}"
        assert err.mean() < 0.15 * miss, f"layer {il}: kernel error {err.mean():.3g}, bias effect {miss:.3g}"
    ctx.close()
