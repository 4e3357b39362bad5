"""edgekv's Expected Attention and KVzip scores equal kvpress's, on identical inputs.

``tests/data/kvpress_frontier.npz`` was written by ``bench/kvpress_fixture.py`` with
kvpress 0.5.5 itself (torch, transformers) on three random Llama attention layers
(6 query heads on 2 KV heads, head size 16, RoPE base 10000, rotate-half pairs):

- ``ExpectedAttentionPress.score`` after a 200-token prefill, with its defaults and with
  neither covariance nor value norm; the fixture keeps the pre-RoPE queries, which edgekv
  receives rotated (as llama.cpp hands them over) and rotates back itself;
- ``KVzipPress.score_kvzip`` for a 72-token repeat pass after a 120-cell context, over
  the chunks [0, 60) and [40, 100).

No torch here: edgekv computes the same scores in float64 from the same numbers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgekv.kvcache.queries import QueryMoments
from edgekv.kvcache.rope import ROPE_NEOX, Rope
from edgekv.kvcache.snapshot import KVSnapshot
from edgekv.methods import get_method
from edgekv.methods.kvzip import reconstruction_scores

FIXTURE = Path(__file__).parent / "data" / "kvpress_frontier.npz"


def fixture() -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURE))


def rope(f: dict[str, np.ndarray]) -> Rope:
    return Rope(ROPE_NEOX, 16, float(f["rope_theta"]), 1.0)  # HF's rotate_half is llama.cpp's NEOX mode


def test_fixture_was_written_by_kvpress() -> None:
    f = fixture()
    assert str(f["versions"][0]).startswith("kvpress 0.5")


@pytest.mark.parametrize("tag", ["default", "plain"])
def test_expected_attention_scores_equal_kvpress(tag: str) -> None:
    f = fixture()
    n = int(f["meta"][0])
    layers = sorted(int(k.rsplit("layer", 1)[1]) for k in f if k.startswith("ea_q_layer"))
    r = rope(f)
    pos = np.arange(n)
    moments = QueryMoments.zeros(r, tuple(layers), frozenset(), 6, 16)
    # llama.cpp hands over queries after RoPE: rotate kvpress's pre-RoPE ones, edgekv undoes it
    post = np.stack([r.rotate(f[f"ea_q_layer{i}"], np.broadcast_to(pos, (6, n))) for i in layers])
    for c0 in range(0, n, 64):  # as prefill chunks arrive
        moments.add(post[:, :, c0 : c0 + 64], pos[c0 : c0 + 64], pos[c0 : c0 + 64])
    snap = KVSnapshot.from_arrays([f[f"ea_k_layer{i}"] for i in layers], [f[f"ea_v_layer{i}"] for i in layers],
                                  moments=moments)
    params = {} if tag == "default" else {"use_covariance": False, "use_vnorm": False}
    method = get_method("expected_attention", **params)
    for i in layers:
        got = method.score(snap, i)
        want = f[f"ea_{tag}_layer{i}"]
        assert np.all(np.isinf(got[:, :4]))  # the sinks: kept regardless (kvpress pads them with its max + 1)
        np.testing.assert_allclose(got[:, 4:], want[:, 4:], rtol=1e-5, atol=1e-9)
        # and so the same cells survive at ratio 0.5, beside the newest cell that edgekv always keeps
        keep = method.select(snap, n // 2)[i]
        ranked = np.concatenate([want[:, :-1], np.full((2, 1), np.inf)], axis=1)
        order = np.argsort(-ranked, axis=1, kind="stable")[:, : n // 2]
        assert np.array_equal(keep, np.sort(order, axis=1)), i


def test_kvzip_scores_equal_kvpress() -> None:
    f = fixture()
    _, ctx, m = (int(x) for x in f["meta"])
    layers = sorted(int(k.rsplit("layer", 1)[1]) for k in f if k.startswith("kvzip_q_layer"))
    cell_pos = np.arange(ctx + m)
    token_pos = np.broadcast_to(cell_pos, (2, ctx + m))
    for lo, hi in f["chunks"]:
        for i in layers:
            got = reconstruction_scores(f[f"kvzip_q_layer{i}"], np.arange(ctx, ctx + m), f[f"kvzip_k_layer{i}"],
                                        cell_pos, token_pos, ctx, 4, int(lo), int(hi), 0.25)
            want = f[f"kvzip_{lo}_{hi}_layer{i}"]
            np.testing.assert_allclose(got[:, :ctx], want, rtol=1e-5, atol=1e-9)
            assert not got[:, :lo].any() and not got[:, hi:].any()  # outside the chunk: nothing
