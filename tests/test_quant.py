"""edgekv.kvcache.quant, which calls ggml's own codecs (libggml-base from llama-cpp-python),
against those codecs entered another way: row by row through the type traits
(``from_float_ref``, ``to_float``) where edgekv converts whole arrays at once.

Every comparison is byte-for-byte (quantize) or bit-for-bit (dequantize, with
NaN positions only required to coincide), so a wrong row size, offset, leading
dimension or type reaching C fails here; so do the properties compaction and
merging rely on (a kept row re-quantises to itself).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from edgekv.errors import StateLayoutError
from edgekv.kvcache import quant
from edgekv.kvcache.quant import GGML_TYPES, dequantize, quantize, row_size, type_by_name

pytestmark = pytest.mark.kernels  # ggml's own quantisers, compiled for this CPU

ALL_TYPES = sorted(GGML_TYPES)
QUANT_TYPES = [t for t in ALL_TYPES if GGML_TYPES[t].block_size == 32]
N = 256  # elements per row in the random tests (8 blocks)
# ggml's non-linear 4-bit codebook (kvalues_iq4nl in ggml-common.h): blocks aimed at its ties
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


# --------------------------------------------------------------------------- the real library


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class Ggml:
    """Thin ctypes wrapper over the few libggml-base entry points the tests need."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib  # edgekv's binding (argument types set), the same library libllama loads
        lib.ggml_row_size.restype = ctypes.c_size_t
        lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.ggml_type_size.restype = ctypes.c_size_t
        lib.ggml_type_size.argtypes = [ctypes.c_int]
        lib.ggml_blck_size.restype = ctypes.c_int64
        lib.ggml_blck_size.argtypes = [ctypes.c_int]
        lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
        lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]

    def traits(self, t: int) -> quant.TypeTraits:
        return self.lib.ggml_get_type_traits(t).contents

    def quantize_chunk(self, x: np.ndarray, t: int) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        nrows, n = x.shape
        out = np.zeros((nrows, self.lib.ggml_row_size(t, n)), np.uint8)
        written = self.lib.ggml_quantize_chunk(t, x.ctypes.data, out.ctypes.data, 0, nrows, n, None)
        assert written == out.size
        return out

    def from_float_ref(self, x: np.ndarray, t: int) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.zeros((x.shape[0], self.lib.ggml_row_size(t, x.shape[1])), np.uint8)
        ptr = self.traits(t).from_float_ref
        if ptr is None:  # f32 has no converter: ggml copies the floats
            return x.view(np.uint8).copy()
        fn = _FROM_FLOAT(ptr)
        for r in range(x.shape[0]):  # one call per row, as llama.cpp's row writers do
            fn(x[r].ctypes.data, out[r].ctypes.data, x.shape[1])
        return out

    def to_float(self, raw: np.ndarray, t: int, n: int) -> np.ndarray:
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        out = np.zeros(raw.shape[:-1] + (n,), np.float32)
        ptr = self.traits(t).to_float
        if ptr is None:  # f32 has no converter: the bytes are the floats
            return raw.view(np.float32).reshape(out.shape).copy()
        _TO_FLOAT(ptr)(raw.ctypes.data, out.ctypes.data, out.size)
        return out


@pytest.fixture(scope="module")
def ggml() -> Ggml:
    return Ggml(quant.ggml_base())


# --------------------------------------------------------------------------- data


def _blocks(rng: np.random.Generator, nblocks: int, scale: float) -> np.ndarray:
    return (rng.standard_normal((nblocks, 32)) * scale).astype(np.float32)


def _special_blocks(rng: np.random.Generator) -> np.ndarray:
    """Blocks aimed at the corner cases of every quantizer (each row is one block)."""
    b: list[np.ndarray] = []
    z = np.zeros(32, np.float32)
    b.append(z)  # all zero
    b.append(-z)  # all negative zero
    one = z.copy()
    one[5] = 3.0
    b.append(one)  # a single non-zero
    for s in (1.0, 1e-3, 1e3):
        v = (rng.standard_normal(32) * 0.01 * s).astype(np.float32)
        v[rng.integers(32)] = 50 * s  # one big positive outlier
        b.append(v)
        w = v.copy()
        w[w == 50 * s] = -50 * s  # one big negative outlier
        b.append(w)
        b.append(-np.abs(rng.standard_normal(32) * s).astype(np.float32))  # negative-dominant
        b.append(np.abs(rng.standard_normal(32) * s).astype(np.float32) + s)  # all positive
    m = rng.standard_normal(32).astype(np.float32)
    m[3], m[20] = 7.0, -7.0  # equal magnitudes of both signs: first one wins
    b.append(m)
    b.append(-m)
    b.append(np.full(32, 0.25, np.float32))  # constant block (q4_1/q5_1: d == 0)
    b.append(np.full(32, -1e-20, np.float32))  # constant, tiny
    # .5 rounding ties: with these maxima the scale is exactly 1, so x*id + c lands on
    # integers / halves (q4_0 d=-8/-8, q5_0 d=-16/-16, q8_0 d=127/127, q4_1/q5_1 d=1).
    halves = np.arange(-8, 8, 0.5, dtype=np.float32)
    b.append(halves)
    b.append(np.concatenate([[-8.0], np.arange(-7.5, 8, 0.5)[:31]]).astype(np.float32))
    b.append(np.concatenate([[-16.0], np.linspace(-15.5, 15.5, 31)]).astype(np.float32))
    b.append(np.concatenate([[127.0], np.arange(-15.5, 15.5, 1.0)]).astype(np.float32))
    b.append(np.concatenate([[-127.0], rng.integers(-120, 120, 31) + 0.5]).astype(np.float32))
    b.append(np.concatenate([[0.0, 15.0], np.arange(0.5, 15.5, 0.5)]).astype(np.float32))
    b.append(np.concatenate([[0.0, 31.0], np.arange(0.5, 30.5, 1.0)]).astype(np.float32))
    # values exactly half-way between fp16 neighbours (scale/min rounding ties)
    b.append(np.concatenate([[1.0 + 2.0**-11, -(1.0 + 3 * 2.0**-11)], rng.standard_normal(30)]))
    # iq4_nl: points half-way between codebook entries once scaled by 1/d = 127/max
    mids = (KVALUES_IQ4NL[:-1].astype(np.float32) + KVALUES_IQ4NL[1:]) / 2
    b.append(np.concatenate([[-127.0], mids, mids, [0.5]]).astype(np.float32))
    b.append(np.concatenate([[113.0], -mids, rng.standard_normal(16) * 40]).astype(np.float32))
    # magnitudes near the ends of float32/fp16 ranges
    b.append((rng.standard_normal(32) * 1e-30).astype(np.float32))  # below iq4_nl's eps
    for top in (9e-16, 1.1e-15):  # either side of iq4_nl's 1e-15 eps
        v = (rng.uniform(-0.5, 0.5, 32) * top).astype(np.float32)
        v[rng.integers(32)] = top
        b.append(v)
    b.append((rng.standard_normal(32) * 1e-9).astype(np.float32))  # fp16 scale underflows
    b.append((rng.standard_normal(32) * 6e4).astype(np.float32))  # fp16 scale near overflow
    b.append((rng.standard_normal(32) * 1e30).astype(np.float32))  # scale overflows fp16
    b.append(rng.integers(-127, 128, 32).astype(np.float32) * np.float32(0.0123))  # on a grid
    return np.stack([np.asarray(v, np.float32) for v in b])


def _random_rows(seed: int) -> np.ndarray:
    """Rows of N values mixing scales, including the special blocks, shuffled per seed."""
    rng = np.random.default_rng(seed)
    parts = [_blocks(rng, 64, s) for s in (1.0, 0.05, 12.0, 3e-6, 1e-12)]
    parts.append(_special_blocks(rng))
    wild = rng.integers(0, 2**32, (16, 32), dtype=np.uint64).astype(np.uint32).view(np.float32)
    parts.append(np.where(np.isfinite(wild), wild, np.float32(1.0)))  # any finite float32
    blocks = np.concatenate(parts)
    blocks = blocks[rng.permutation(len(blocks))]
    blocks = blocks[: len(blocks) // 8 * 8]
    return np.ascontiguousarray(blocks.reshape(-1, N), dtype=np.float32)


def _assert_same_floats(ours: np.ndarray, ref: np.ndarray) -> None:
    """Bit-identical floats; NaN positions must coincide (payloads are hardware detail)."""
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    nan_o, nan_r = np.isnan(ours), np.isnan(ref)
    np.testing.assert_array_equal(nan_o, nan_r)
    bad = (ours.view(np.uint32) != ref.view(np.uint32)) & ~nan_r
    assert not bad.any(), f"{bad.sum()} values differ, first at {np.argwhere(bad)[0]}"


def _assert_same_bytes(ours: np.ndarray, ref: np.ndarray, t: int) -> None:
    assert ours.dtype == np.uint8 and ours.shape == ref.shape
    ts = GGML_TYPES[t].type_size
    o, r = ours.reshape(-1, ts), ref.reshape(-1, ts)
    bad = np.flatnonzero((o != r).any(axis=1))
    assert bad.size == 0, f"{GGML_TYPES[t].name}: {bad.size} blocks differ, first #{bad[0]}"


# --------------------------------------------------------------------------- type table


@pytest.mark.parametrize("t", ALL_TYPES)
def test_type_table_matches_ggml(ggml: Ggml, t: int) -> None:
    ours = GGML_TYPES[t]
    tr = ggml.traits(t)
    assert ours.id == t
    assert ours.name == tr.type_name.decode()
    assert ours.block_size == ggml.lib.ggml_blck_size(t) == tr.blck_size
    assert ours.type_size == ggml.lib.ggml_type_size(t) == tr.type_size
    assert not ggml.lib.ggml_quantize_requires_imatrix(t)
    for n in (0, 32, 64, 192, 4096):
        assert row_size(t, n) == ggml.lib.ggml_row_size(t, n)


def test_type_by_name() -> None:
    for name in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"):
        assert type_by_name(name).name == name
    assert type_by_name("Q8_0").id == 8
    for bad in ("q4_k", "f64", "", "q8"):
        with pytest.raises(StateLayoutError) as e:
            type_by_name(bad)
        assert "iq4_nl" in str(e.value) and "\n" not in str(e.value)


def test_kv_types_split_k_and_v() -> None:
    from edgekv.ggml_types import kv_kwargs, kv_types

    assert kv_types("q8_0") == ("q8_0", "q8_0")
    assert kv_types("Q8_0/q4_0") == ("q8_0", "q4_0")
    assert kv_kwargs("f16/q8_0") == {"cache_type_k": "f16", "cache_type_v": "q8_0"}
    for bad in ("q8_0/q4_0/f16", "q8_0/", "/q4_0", "q8_0/q4_k"):
        with pytest.raises(StateLayoutError) as e:
            kv_types(bad)
        assert "\n" not in str(e.value)


def test_layout_errors() -> None:
    with pytest.raises(StateLayoutError):
        row_size(8, 48)
    with pytest.raises(StateLayoutError):
        row_size(12, 256)  # q4_K: not a KV cache type here
    with pytest.raises(StateLayoutError):
        dequantize(np.zeros(33, np.uint8), 8, 32)
    with pytest.raises(TypeError):
        dequantize(np.zeros(34, np.int8), 8, 32)
    with pytest.raises(StateLayoutError):
        quantize(np.zeros(48, np.float32), 2)


# --------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("t", ALL_TYPES)
def test_quantize_matches_ggml_quantize_chunk(ggml: Ggml, t: int, seed: int) -> None:
    x = _random_rows(seed)
    _assert_same_bytes(quantize(x, t), ggml.quantize_chunk(x, t), t)


@pytest.mark.parametrize("t", [t for t in ALL_TYPES if t != quant.GGML_TYPE_IQ4_NL])
def test_quantize_matches_from_float_ref(ggml: Ggml, t: int) -> None:
    # iq4_nl is excluded on purpose: its from_float_ref skips the scale search
    # that ggml_quantize_chunk (quantize_iq4_nl) performs.
    x = _random_rows(7)
    _assert_same_bytes(quantize(x, t), ggml.from_float_ref(x, t), t)


@pytest.mark.parametrize("t", [1, 30])
def test_half_formats_on_arbitrary_bits(ggml: Ggml, t: int) -> None:
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    specials = np.array(
        [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001,
         0x00000001, 0x477FF000, 0x477FEFFF, 0x477FF001, 0x33000000, 0x33000001,
         0x387FC000, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF],
        dtype=np.uint32,
    )  # fmt: skip
    x = np.concatenate([bits, specials, np.zeros(256 - len(specials) % 256, np.uint32)])
    x = x.view(np.float32).reshape(-1, 256)
    ours = quantize(x, t)
    _assert_same_bytes(ours, ggml.quantize_chunk(x, t), t)
    _assert_same_floats(dequantize(ours, t, 256), ggml.to_float(ours, t, 256))


@pytest.mark.parametrize("t", QUANT_TYPES)
def test_quantize_non_finite(ggml: Ggml, t: int) -> None:
    # Not a goal in itself (a cache with inf/NaN is broken), but the emulated C
    # semantics should hold here too.
    x = _random_rows(11)[:8].copy()
    x[0, 3] = np.nan
    x[1, 40] = np.inf
    x[2, 70] = -np.inf
    x[3, 96:128] = np.nan
    x[4, 127] = np.nan
    x[5, 160:192] = np.inf
    _assert_same_bytes(quantize(x, t), ggml.quantize_chunk(x, t), t)


def test_quantize_leading_dims_and_dtype() -> None:
    x = _random_rows(4)
    x3 = x[: x.shape[0] // 2 * 2].reshape(2, -1, N)
    for t in ALL_TYPES:
        q = quantize(x3, t)
        assert q.shape == (2, x3.shape[1], row_size(t, N)) and q.dtype == np.uint8
        np.testing.assert_array_equal(q.reshape(-1, q.shape[-1]), quantize(x3.reshape(-1, N), t))
        np.testing.assert_array_equal(quantize(x3.astype(np.float64), t), q)
        assert quantize(x3[:, :0], t).shape == (2, 0, row_size(t, N))


# --------------------------------------------------------------------------- dequantize


@pytest.mark.parametrize("t", ALL_TYPES)
def test_dequantize_matches_ggml_to_float(ggml: Ggml, t: int) -> None:
    rng = np.random.default_rng(5)
    rs = row_size(t, N)
    raw = rng.integers(0, 256, (64, rs), dtype=np.uint8)  # arbitrary bytes: NaN/inf scales too
    real = quantize(_random_rows(6), t)  # and realistic rows
    for r in (raw, real):
        _assert_same_floats(dequantize(r, t, N), ggml.to_float(r, t, N))


@pytest.mark.parametrize("t", [1, 30])
def test_dequantize_every_half_bit_pattern(ggml: Ggml, t: int) -> None:
    raw = np.arange(1 << 16, dtype=np.uint16).astype("<u2").view(np.uint8).reshape(-1, 512)
    _assert_same_floats(dequantize(raw, t, 256), ggml.to_float(raw, t, 256))


def test_dequantize_leading_dims() -> None:
    x = _random_rows(8)
    for t in ALL_TYPES:
        q = quantize(x, t)
        q3 = q[: q.shape[0] // 2 * 2].reshape(2, -1, q.shape[-1])
        y = dequantize(q3, t, N)
        assert y.shape == (2, q3.shape[1], N) and y.dtype == np.float32
        assert q.shape[-1] == row_size(t, N)
        np.testing.assert_array_equal(
            y.reshape(-1, N), dequantize(q3.reshape(-1, q.shape[-1]), t, N)
        )


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("t", [quant.GGML_TYPE_Q8_0, quant.GGML_TYPE_Q4_0])
def test_requantising_a_kept_row_is_identity(t: int) -> None:
    x = np.concatenate([_random_rows(s) for s in (20, 21)])
    q = quantize(x, t)
    # A block whose scale rounds to fp16 zero/inf decodes to zeros/non-finite and
    # cannot be recovered; such blocks never occur in a healthy cache.
    ts = GGML_TYPES[t].type_size
    blocks = q.reshape(-1, ts)
    d = blocks[:, 0].astype(np.uint16) | (blocks[:, 1].astype(np.uint16) << 8)
    ok = ((d & 0x7FFF) != 0) & ((d & 0x7C00) != 0x7C00)
    assert ok.mean() > 0.6
    q2 = quantize(dequantize(q, t, N), t)
    np.testing.assert_array_equal(q2.reshape(-1, ts)[ok], blocks[ok])


@pytest.mark.parametrize("t", [0, 1, 30])
def test_float_formats_round_trip(t: int) -> None:
    x = _random_rows(9)
    y = dequantize(quantize(x, t), t, N)
    np.testing.assert_array_equal(quantize(y, t), quantize(x, t))
    if t == 0:
        np.testing.assert_array_equal(y, x)
