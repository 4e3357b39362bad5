"""The state-blob parser on synthetic blobs built field by field from the layout
in llama.cpp's llama_kv_cache::state_write (independent of layout.write_seq_state)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from edgekv.errors import StateLayoutError
from edgekv.kvcache import layout


def make_blob(n_cells: int, n_layer: int, n_embd: int, *, v_trans: bool, seed: int = 0,
              n_stream: int = 1, pos: np.ndarray | None = None) -> tuple[bytes, dict]:
    rng = np.random.default_rng(seed)
    pos = np.arange(n_cells, dtype=np.int32) if pos is None else pos
    out = [struct.pack("<Ii", 0xAF143CD8, 0), struct.pack("<I", n_stream), struct.pack("<I", n_cells)]
    for p in pos:
        out.append(struct.pack("<iIi", int(p), 1, 0))
    out.append(struct.pack("<II", int(v_trans), n_layer))
    ks, vs = [], []
    for _ in range(n_layer):
        k = rng.standard_normal((n_cells, n_embd)).astype(np.float16)
        ks.append(k)
        out.append(struct.pack("<iQ", 1, n_embd * 2))
        out.append(k.tobytes())
    for _ in range(n_layer):
        v = rng.standard_normal((n_cells, n_embd)).astype(np.float16)
        vs.append(v)
        if not v_trans:
            out.append(struct.pack("<iQ", 1, n_embd * 2))
            out.append(v.tobytes())
        else:
            out.append(struct.pack("<iII", 1, 2, n_embd))
            out.append(np.ascontiguousarray(v.T).tobytes())
    for _ in range(n_stream - 1):
        out.append(struct.pack("<I", 0))
    return b"".join(out), {"k": ks, "v": vs, "pos": pos}


@pytest.mark.parametrize("v_trans", [False, True])
def test_roundtrip_is_byte_identical(v_trans: bool) -> None:
    blob, ref = make_blob(37, 3, 2 * 8, v_trans=v_trans)
    st = layout.parse_seq_state(blob, n_caches=1, n_layers=[3])
    sec = st.sections[0]
    assert sec.n_cells == 37 and sec.v_trans == v_trans
    np.testing.assert_array_equal(sec.pos, ref["pos"])
    for il in range(3):
        assert sec.layers[il].k.tobytes() == ref["k"][il].tobytes()
    assert layout.write_seq_state(st) == blob


@pytest.mark.parametrize("v_trans", [False, True])
def test_gather_moves_per_head_rows(v_trans: bool) -> None:
    n, n_layer, n_head, d = 20, 2, 2, 8
    blob, ref = make_blob(n, n_layer, n_head * d, v_trans=v_trans, seed=3)
    sec = layout.parse_seq_state(blob, n_caches=1, n_layers=[n_layer]).sections[0]
    rng = np.random.default_rng(1)
    keep = np.stack([np.stack([np.sort(rng.choice(n - 1, 6, replace=False)) for _ in range(n_head)])
                     for _ in range(n_layer)])
    keep = np.concatenate([keep, np.full((n_layer, n_head, 1), n - 1)], axis=2)
    new = layout.gather_section(sec, np.arange(n), keep, np.arange(7), n_head)
    for il in range(n_layer):
        k_new = np.frombuffer(new.layers[il].k.tobytes(), np.float16).reshape(7, n_head, d)
        if v_trans:
            v_new = np.frombuffer(new.layers[il].v.tobytes(), np.float16).reshape(n_head * d, 7).T
        else:
            v_new = np.frombuffer(new.layers[il].v.tobytes(), np.float16).reshape(7, n_head * d)
        v_new = v_new.reshape(7, n_head, d)
        for h in range(n_head):
            k_ref = ref["k"][il].reshape(n, n_head, d)[keep[il, h], h]
            v_ref = ref["v"][il].reshape(n, n_head, d)[keep[il, h], h]
            np.testing.assert_array_equal(k_new[:, h], k_ref)
            np.testing.assert_array_equal(v_new[:, h], v_ref)


def test_bad_magic() -> None:
    blob, _ = make_blob(4, 1, 8, v_trans=False)
    with pytest.raises(StateLayoutError, match="magic"):
        layout.parse_seq_state(b"\0\0\0\0" + blob[4:], n_caches=1, n_layers=[1])


def test_truncated() -> None:
    blob, _ = make_blob(4, 2, 8, v_trans=False)
    for cut in (3, 10, 30, len(blob) - 1):
        with pytest.raises(StateLayoutError, match="truncated"):
            layout.parse_seq_state(blob[:cut], n_caches=1, n_layers=[2])


def test_trailing_bytes_and_wrong_layer_count() -> None:
    blob, _ = make_blob(4, 2, 8, v_trans=False)
    with pytest.raises(StateLayoutError, match="trailing"):
        layout.parse_seq_state(blob + b"\0" * 8, n_caches=1, n_layers=[2])
    with pytest.raises(StateLayoutError, match="layers"):
        layout.parse_seq_state(blob, n_caches=1, n_layers=[3])


def test_empty_other_streams_are_skipped() -> None:
    blob, _ = make_blob(5, 1, 8, v_trans=False, n_stream=3)
    sec = layout.parse_seq_state(blob, n_caches=1, n_layers=[1]).sections[0]
    assert sec.n_stream == 3 and sec.stream == 0 and sec.n_cells == 5
    assert layout.write_seq_state(layout.parse_seq_state(blob, n_caches=1, n_layers=[1])) == blob
