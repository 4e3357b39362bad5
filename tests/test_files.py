"""Session files without a model: versions 2, 3 and 4 of the format, counts that
are not counts refused with one line, and corrupted files rejected by the checksum."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from edgekv.errors import EdgekvError
from edgekv.kvcache.engine import CacheState
from edgekv.kvcache.files import DIGEST, MAGIC, load_cache_file, save_cache_file

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


def test_version_4_roundtrip_and_bad_counts(tmp_path) -> None:
    tp = np.broadcast_to(np.arange(N, dtype=np.int32), (L, H, N)).copy()
    counts = np.ones((L, H, N), np.float32)
    counts[0, 1, 2] = 3
    for bias in (False, True):
        save_cache_file(tmp_path / "c.ekv", CacheState(b"blob", tp, "state", counts=counts, bias=bias), {})
        state, header = load_cache_file(tmp_path / "c.ekv", "state")
        assert header["version"] == 4 and state.bias == bias and np.array_equal(state.counts, counts)
    for bad in (0.0, -1.0, np.nan):
        c = counts.copy()
        c[1, 0, 4] = bad
        save_cache_file(tmp_path / "d.ekv", CacheState(b"blob", tp, "state", counts=c), {})
        with pytest.raises(EdgekvError, match="not counts") as e:
            load_cache_file(tmp_path / "d.ekv", "state")
        assert "\n" not in str(e.value)


def _state() -> CacheState:
    rng = np.random.default_rng(0)
    tp = np.broadcast_to(np.arange(N, dtype=np.int32), (L, H, N)).copy()
    counts = rng.integers(1, 5, (L, H, N)).astype(np.float32)
    return CacheState(rng.bytes(4000), tp, "native", counts=counts, bias=True)


def test_version_3_without_checksum_still_loads(tmp_path) -> None:
    save_cache_file(tmp_path / "v4.ekv", _state(), {"model": "m"})
    data = (tmp_path / "v4.ekv").read_bytes()[:-DIGEST]
    hl = int.from_bytes(data[8:12], "little")
    header = json.loads(data[12 : 12 + hl])
    header["version"] = 3
    hb = json.dumps(header).encode()
    (tmp_path / "v3.ekv").write_bytes(MAGIC + len(hb).to_bytes(4, "little") + hb + data[12 + hl :])
    state, header = load_cache_file(tmp_path / "v3.ekv", "native")
    assert header["version"] == 3 and state.blob == _state().blob and np.array_equal(state.counts, _state().counts)


def test_every_mutation_of_a_file_is_rejected(tmp_path) -> None:
    """Bit flips, byte changes, splices and truncations anywhere (header, token map, the
    llama.cpp blob, counts, the digest): one-line errors, never a silently different state."""
    save_cache_file(tmp_path / "good.ekv", _state(), {"model": "m"})
    good = (tmp_path / "good.ekv").read_bytes()
    rng = random.Random(0)
    bad = tmp_path / "bad.ekv"
    for _ in range(400):
        data = bytearray(good)
        kind = rng.randrange(4)
        i = rng.randrange(len(data))
        if kind == 0:
            data[i] ^= 1 << rng.randrange(8)
        elif kind == 1:
            data[i] = (data[i] + rng.randrange(1, 256)) % 256
        elif kind == 2:  # splice: a run of bytes copied from elsewhere in the file
            j, n = rng.randrange(len(data)), rng.randrange(1, 64)
            data[i : i + n] = good[j : j + n]
        else:
            data = data[:i]
        if bytes(data) == good:
            continue
        bad.write_bytes(bytes(data))
        with pytest.raises(EdgekvError) as e:
            load_cache_file(bad, "native")
        assert "\n" not in str(e.value)
