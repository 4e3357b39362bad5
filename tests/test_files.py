"""Session files without a model: versions 2 and 3 of the format, and counts that
are not counts refused with one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgekv.errors import EdgekvError
from edgekv.kvcache.engine import CacheState
from edgekv.kvcache.files import MAGIC, load_cache_file, save_cache_file

L, H, N = 2, 3, 5


def _v2(path, bias: np.ndarray) -> None:
    """A version 2 file as session 5 wrote it: the log-count bias as an array."""
    tp = np.arange(L * H * N, dtype="<i4").reshape(L, H, N)
    blob = b"llama.cpp state"
    header = {"version": 2, "token_pos_shape": [L, H, N], "blob_len": len(blob),
              "arrays": [{"name": "bias", "dtype": "f4", "shape": [L, H, N]}]}
    hb = json.dumps(header).encode()
    path.write_bytes(MAGIC + len(hb).to_bytes(4, "little") + hb + tp.tobytes() + blob
                     + bias.astype("<f4").tobytes())


def test_version_2_bias_loads_as_counts(tmp_path) -> None:
    counts = np.ones((L, H, N), np.float32)
    counts[1, 2, 3] = 7
    _v2(tmp_path / "a.ekv", np.log(counts))
    state, _ = load_cache_file(tmp_path / "a.ekv", "native")
    assert state.bias and np.array_equal(state.counts, counts)
    # a bias that was switched on but never merged anything: plain cells
    _v2(tmp_path / "b.ekv", np.zeros((L, H, N)))
    state, _ = load_cache_file(tmp_path / "b.ekv", "state")
    assert state.counts is None and not state.bias


def test_version_3_roundtrip_and_bad_counts(tmp_path) -> None:
    tp = np.broadcast_to(np.arange(N, dtype=np.int32), (L, H, N)).copy()
    counts = np.ones((L, H, N), np.float32)
    counts[0, 1, 2] = 3
    for bias in (False, True):
        save_cache_file(tmp_path / "c.ekv", CacheState(b"blob", tp, "state", counts=counts, bias=bias), {})
        state, header = load_cache_file(tmp_path / "c.ekv", "state")
        assert header["version"] == 3 and state.bias == bias and np.array_equal(state.counts, counts)
    for bad in (0.0, -1.0, np.nan):
        c = counts.copy()
        c[1, 0, 4] = bad
        save_cache_file(tmp_path / "d.ekv", CacheState(b"blob", tp, "state", counts=c), {})
        with pytest.raises(EdgekvError, match="not counts") as e:
            load_cache_file(tmp_path / "d.ekv", "state")
        assert "\n" not in str(e.value)
