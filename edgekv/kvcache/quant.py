"""Bit-exact numpy codecs for the ggml tensor types llama.cpp accepts as KV-cache types.

A llama.cpp sequence-state blob stores each layer's K and V rows in the cache's
ggml type (``--cache-type-k/-v``).  edgekv edits those blobs: compaction gathers
a subset of cells, merging averages cells and writes the result back.  Both only
stay honest if this module reproduces ggml *exactly*:

* :func:`dequantize` gives the very floats ggml's ``to_float`` gives, so any
  scoring or merging done here sees what the model itself sees;
* :func:`quantize` gives the very bytes ``ggml_quantize_chunk`` writes (for these
  types without an importance matrix), so re-quantising a row is deterministic
  and a kept row that goes through ``quantize(dequantize(row))`` comes back
  unchanged for the scale/round types (checked for q8_0 and q4_0 in the tests),
  i.e. compaction never perturbs the data it keeps.

All codecs work on every block at once (no Python loop over blocks); iq4_nl's
scale search loops only over its 15 trial scales and 32 in-block positions, to
keep ggml's sequential float32 summation order.  Work is split into chunks of
blocks so temporaries stay bounded on whole caches.

Floating-point emulation notes (all verified against the real library in
``tests/test_quant.py``):

* ggml-base is compiled without ``-march=native`` and without ``-ffast-math``,
  so the reference quantizers run plain IEEE float32 SSE arithmetic with no FMA
  contraction; numpy float32 arithmetic (which never fuses) reproduces it when
  every intermediate is kept in float32, in ggml's operation order.
* C's float-to-``int8_t``/``uint8_t`` casts compile to ``cvttss2si`` (truncate,
  NaN/out-of-range give ``INT_MIN``) followed by taking the low byte; see
  :func:`_c_float_to_u8`.
* ``GGML_FP32_TO_FP16`` is round-to-nearest-even with NaN mapped to
  ``sign | 0x7E00``; ``GGML_FP16_TO_FP32`` is exact and quiets NaNs.

Non-finite inputs follow the same emulated C semantics, but are not a goal: a
KV cache holding inf/NaN is already broken.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import StateLayoutError
from ..ggml_types import (  # noqa: F401  (re-exported: the codecs' public names)
    GGML_TYPE_BF16,
    GGML_TYPE_F16,
    GGML_TYPE_F32,
    GGML_TYPE_IQ4_NL,
    GGML_TYPE_Q4_0,
    GGML_TYPE_Q4_1,
    GGML_TYPE_Q5_0,
    GGML_TYPE_Q5_1,
    GGML_TYPE_Q8_0,
    GGML_TYPES,
    GGMLType,
    _get_type,
    row_size,
    type_by_name,
)

__all__ = [
    "GGMLType",
    "GGML_TYPES",
    "GGML_TYPE_F32",
    "GGML_TYPE_F16",
    "GGML_TYPE_Q4_0",
    "GGML_TYPE_Q4_1",
    "GGML_TYPE_Q5_0",
    "GGML_TYPE_Q5_1",
    "GGML_TYPE_Q8_0",
    "GGML_TYPE_IQ4_NL",
    "GGML_TYPE_BF16",
    "KVALUES_IQ4NL",
    "type_by_name",
    "row_size",
    "dequantize",
    "quantize",
    "fp32_to_fp16_bits",
    "fp16_bits_to_fp32",
    "fp32_to_bf16_bits",
    "bf16_bits_to_fp32",
]


#: ggml's non-linear 4-bit codebook (``kvalues_iq4nl`` in ggml-common.h).
KVALUES_IQ4NL = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8
)
_KV_F32 = KVALUES_IQ4NL.astype(np.float32)

_QK = 32  # block size of every quantized KV type
_CHUNK_BLOCKS = 1 << 15  # blocks per vectorised chunk: bounds temporaries on whole caches

_F32 = np.float32
_U32 = np.uint32


# --------------------------------------------------------------------------- scalar formats


def fp32_to_fp16_bits(x: np.ndarray) -> np.ndarray:
    """``GGML_FP32_TO_FP16`` on an array: round-to-nearest-even, NaN -> ``sign|0x7E00``.

    numpy's cast is IEEE round-to-nearest-even (overflow to inf, exact
    subnormals) like ggml's bit trick; only the NaN payload differs, so it is
    patched to ggml's canonical quiet NaN.
    """
    x = np.asarray(x, dtype=_F32)
    with np.errstate(over="ignore", invalid="ignore"):
        h = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        sign = (x.view(_U32) >> 16).astype(np.uint16) & np.uint16(0x8000)
        h = np.where(nan, sign | np.uint16(0x7E00), h)
    return h


def fp16_bits_to_fp32(h: np.ndarray) -> np.ndarray:
    """``GGML_FP16_TO_FP32`` on an array of raw half bits (exact; NaNs come back quiet)."""
    h = np.asarray(h, dtype=np.uint16)
    out = h.view(np.float16).astype(_F32)
    nan = (h & 0x7C00 == 0x7C00) & (h & 0x03FF != 0)
    if nan.any():
        # ggml rebuilds the float bits and multiplies by 2^-112, which quiets the NaN.
        hb = h.astype(_U32)
        bits = ((hb & 0x8000) << 16) | _U32(0x7FC00000) | ((hb & 0x03FF) << 13)
        out = np.where(nan, bits.view(_F32), out)
    return out


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """``ggml_compute_fp32_to_bf16``: round-to-nearest-even; NaN keeps its top bits, forced quiet."""
    u = np.asarray(x, dtype=_F32).view(_U32)
    rounded = (u + (_U32(0x7FFF) + ((u >> 16) & 1))) >> 16
    quiet_nan = (u >> 16) | _U32(64)
    return np.where((u & 0x7FFFFFFF) > 0x7F800000, quiet_nan, rounded).astype(np.uint16)


def bf16_bits_to_fp32(h: np.ndarray) -> np.ndarray:
    """``ggml_compute_bf16_to_fp32``: the bits shifted into the top half (exact)."""
    return (np.asarray(h, dtype=np.uint16).astype(_U32) << 16).view(_F32)


# --------------------------------------------------------------------------- C-semantics helpers


def _c_float_to_u8(t: np.ndarray) -> np.ndarray:
    """Low byte of C's float->int conversion (``cvttss2si``), as uint8.

    ``(int8_t)f`` / ``(uint8_t)f`` truncate toward zero; NaN and out-of-range
    values become ``INT_MIN`` whose low byte is 0.
    """
    with np.errstate(invalid="ignore"):
        ok = np.abs(t) < _F32(2.0**31)
        i = np.where(ok, t, _F32(-(2.0**31))).astype(np.int32)
    return i.astype(np.uint8)  # integer narrowing wraps, like the low-byte read


def _min_int8(xi: np.ndarray, hi: int) -> np.ndarray:
    """``MIN(hi, (int8_t)v)`` where ``xi`` holds the cast's byte; result as uint8 byte."""
    return np.minimum(xi.view(np.int8), np.int8(hi)).view(np.uint8)


def _roundf(x: np.ndarray) -> np.ndarray:
    """C ``roundf``: half away from zero (numpy's ``round`` is half-to-even)."""
    r = np.trunc(x)
    frac = x - r  # exact in float32 (Sterbenz)
    return r + np.where(np.abs(frac) >= _F32(0.5), np.sign(x), _F32(0)).astype(_F32)


def _recip_or_zero(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f/d : 0.0f``."""
    with np.errstate(divide="ignore"):
        return np.where(d != 0, _F32(1) / d, _F32(0)).astype(_F32)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """Per block, the first element of largest magnitude, with its sign (q4_0/q5_0/iq4_nl).

    Mirrors ``if (amax < fabsf(v)) { amax = fabsf(v); max = v; }`` starting from
    ``amax = max = 0``: strict comparison keeps the first maximum, NaN is never
    chosen, and an all-zero block yields ``+0``.
    """
    a = np.abs(x)
    a = np.where(np.isnan(a), _F32(-1), a)
    idx = np.argmax(a, axis=-1)
    rows = np.arange(x.shape[0])
    return np.where(a[rows, idx] > 0, x[rows, idx], _F32(0)).astype(_F32)


def _u16_le(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return lo.astype(np.uint16) | (hi.astype(np.uint16) << 8)


def _put_u16(out: np.ndarray, col: int, v: np.ndarray) -> None:
    out[:, col] = (v & 0xFF).astype(np.uint8)
    out[:, col + 1] = (v >> 8).astype(np.uint8)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """ggml's nibble order: byte j holds element j (low) and element j+16 (high)."""
    return ((q[:, :16] & 0x0F) | (q[:, 16:] << 4)).astype(np.uint8)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


_BIT = np.arange(32, dtype=_U32)


def _pack_high_bits(q: np.ndarray) -> np.ndarray:
    """qh (4 little-endian bytes): bit j is bit 4 of element j."""
    qh = (((q.astype(_U32) & 0x10) >> 4) << _BIT).sum(axis=1, dtype=_U32)
    return np.stack([(qh >> s) & 0xFF for s in (0, 8, 16, 24)], axis=1).astype(np.uint8)


def _unpack_high_bits(qh: np.ndarray) -> np.ndarray:
    v = qh.astype(_U32)
    word = v[:, 0] | (v[:, 1] << 8) | (v[:, 2] << 16) | (v[:, 3] << 24)
    return (((word[:, None] >> _BIT) & 1) << 4).astype(np.uint8)


# --------------------------------------------------------------------------- block codecs
# Quantizers take float32 blocks (M, 32) and return uint8 (M, type_size);
# dequantizers take uint8 (M, type_size) and return float32 (M, 32).


def _quant_q4_0(x: np.ndarray) -> np.ndarray:
    mx = _signed_absmax(x)
    with np.errstate(all="ignore"):
        d = mx / _F32(-8)
        iden = _recip_or_zero(d)
        xi = _min_int8(_c_float_to_u8(x * iden[:, None] + _F32(8.5)), 15)
    out = np.empty((x.shape[0], 18), np.uint8)
    _put_u16(out, 0, fp32_to_fp16_bits(d))
    out[:, 2:] = ((xi[:, :16]) | (xi[:, 16:] << 4)).astype(np.uint8)  # no mask: C ORs raw bytes
    return out


def _deq_q4_0(b: np.ndarray) -> np.ndarray:
    d = fp16_bits_to_fp32(_u16_le(b[:, 0], b[:, 1]))
    q = _unpack_nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
    return q.astype(_F32) * d[:, None]


def _minmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``v < min`` / ``v > max`` scans from ``FLT_MAX``/``-FLT_MAX``; NaN never taken."""
    nan = np.isnan(x)
    big = np.finfo(_F32).max
    mn = np.minimum(np.where(nan, big, x).min(axis=1), big)  # the scan starts at FLT_MAX,
    mx = np.maximum(np.where(nan, -big, x).max(axis=1), -big)  # so +inf never becomes min
    return mn.astype(_F32), mx.astype(_F32)


def _quant_q4_1(x: np.ndarray) -> np.ndarray:
    mn, mx = _minmax(x)
    with np.errstate(all="ignore"):
        d = (mx - mn) / _F32(15)
        iden = _recip_or_zero(d)
        xi = _min_int8(_c_float_to_u8((x - mn[:, None]) * iden[:, None] + _F32(0.5)), 15)
    out = np.empty((x.shape[0], 20), np.uint8)
    _put_u16(out, 0, fp32_to_fp16_bits(d))
    _put_u16(out, 2, fp32_to_fp16_bits(mn))
    out[:, 4:] = (xi[:, :16] | (xi[:, 16:] << 4)).astype(np.uint8)
    return out


def _deq_q4_1(b: np.ndarray) -> np.ndarray:
    d = fp16_bits_to_fp32(_u16_le(b[:, 0], b[:, 1]))
    m = fp16_bits_to_fp32(_u16_le(b[:, 2], b[:, 3]))
    q = _unpack_nibbles(b[:, 4:])
    return q.astype(_F32) * d[:, None] + m[:, None]


def _quant_q5_0(x: np.ndarray) -> np.ndarray:
    mx = _signed_absmax(x)
    with np.errstate(all="ignore"):
        d = mx / _F32(-16)
        iden = _recip_or_zero(d)
        xi = _min_int8(_c_float_to_u8(x * iden[:, None] + _F32(16.5)), 31)
    out = np.empty((x.shape[0], 22), np.uint8)
    _put_u16(out, 0, fp32_to_fp16_bits(d))
    out[:, 2:6] = _pack_high_bits(xi)
    out[:, 6:] = _pack_nibbles(xi)
    return out


def _deq_q5_0(b: np.ndarray) -> np.ndarray:
    d = fp16_bits_to_fp32(_u16_le(b[:, 0], b[:, 1]))
    q = (_unpack_nibbles(b[:, 6:]) | _unpack_high_bits(b[:, 2:6])).astype(np.int8) - np.int8(16)
    return q.astype(_F32) * d[:, None]


def _quant_q5_1(x: np.ndarray) -> np.ndarray:
    mn, mx = _minmax(x)
    with np.errstate(all="ignore"):
        d = (mx - mn) / _F32(31)
        iden = _recip_or_zero(d)
        xi = _c_float_to_u8((x - mn[:, None]) * iden[:, None] + _F32(0.5))  # no MIN in ggml
    out = np.empty((x.shape[0], 24), np.uint8)
    _put_u16(out, 0, fp32_to_fp16_bits(d))
    _put_u16(out, 2, fp32_to_fp16_bits(mn))
    out[:, 4:8] = _pack_high_bits(xi)
    out[:, 8:] = _pack_nibbles(xi)
    return out


def _deq_q5_1(b: np.ndarray) -> np.ndarray:
    d = fp16_bits_to_fp32(_u16_le(b[:, 0], b[:, 1]))
    m = fp16_bits_to_fp32(_u16_le(b[:, 2], b[:, 3]))
    q = _unpack_nibbles(b[:, 8:]) | _unpack_high_bits(b[:, 4:8])
    return q.astype(_F32) * d[:, None] + m[:, None]


def _q8_amax(x: np.ndarray) -> np.ndarray:
    """``amax = MAX(amax, fabsf(v))`` from 0 with ``MAX(a,b) = a > b ? a : b``.

    For finite data this is the plain max of |x|.  A NaN element makes the fold
    NaN and the next element replaces it, so only elements after the last NaN
    count (and a trailing NaN leaves NaN).
    """
    a = np.abs(x)
    nan = np.isnan(a)
    if not nan.any():
        return a.max(axis=1)
    n = x.shape[1]
    last_nan = np.where(nan.any(axis=1), n - 1 - np.argmax(nan[:, ::-1], axis=1), -1)
    after = np.arange(n)[None, :] > last_nan[:, None]
    amax = np.where(after, a, _F32(0)).max(axis=1)
    return np.where(last_nan == n - 1, _F32(np.nan), amax).astype(_F32)


def _quant_q8_0(x: np.ndarray) -> np.ndarray:
    amax = _q8_amax(x)
    with np.errstate(all="ignore"):
        d = amax / _F32(127)
        iden = np.where(d != 0, _F32(1) / d, _F32(0)).astype(_F32)  # NaN is truthy in C
        qs = _c_float_to_u8(_roundf(x * iden[:, None]))
    out = np.empty((x.shape[0], 34), np.uint8)
    _put_u16(out, 0, fp32_to_fp16_bits(d))
    out[:, 2:] = qs
    return out


def _deq_q8_0(b: np.ndarray) -> np.ndarray:
    d = fp16_bits_to_fp32(_u16_le(b[:, 0], b[:, 1]))
    return b[:, 2:].view(np.int8).astype(_F32) * d[:, None]


# best_index_int8 returns the index of the nearer codebook neighbour, judged with
# float32 differences ``x - lo < hi - x`` (ties go up).  Near a tie both differences
# are exact in float32 (|x| >= 4 there and the half-gaps are <= 12), and away from a
# tie rounding cannot flip a strict comparison, so the result is exactly "the number
# of neighbour midpoints <= x".  Doubled midpoints are integers, so that count
# depends only on floor(2x): tabulate it for floor(2x) in -256..228 (2x clamped).
_TWICE_MID = KVALUES_IQ4NL[:-1].astype(np.int32) + KVALUES_IQ4NL[1:]
_T_LO, _T_HI = -256, 228
_IDX_LUT = np.searchsorted(_TWICE_MID, np.arange(_T_LO, _T_HI + 1), side="right").astype(np.uint8)
_VAL_LUT = _KV_F32[_IDX_LUT]


def _best_index(al2: np.ndarray) -> np.ndarray:
    """Table row for ``best_index_int8(16, kvalues_iq4nl, x)`` given ``al2 = 2*x``.

    Index ``_IDX_LUT`` / ``_VAL_LUT`` with the result.  Doubling a float32 is
    exact, so callers compute ``(2*id) * x`` instead of ``2 * (id*x)``.  Clamping
    covers the C early-outs (``x <= -127`` -> 0, ``x >= 113`` -> 15); ``fmin``
    sends NaN to the top, matching C where every comparison with NaN is false.
    """
    f = np.maximum(np.fmin(al2, _F32(_T_HI)), _F32(_T_LO))
    return (np.floor(f) - _F32(_T_LO)).astype(np.intp)


def _seq_sum(a: np.ndarray) -> np.ndarray:
    """Sum over axis 0 strictly left to right in float32, like ggml's ``s += ...`` loops."""
    s = np.zeros(a.shape[1:], _F32)
    for row in a:
        s = s + row
    return s


def _quant_iq4_nl(x: np.ndarray) -> np.ndarray:
    """``quantize_iq4_nl`` without imatrix (``quantize_row_iq4_nl_impl``, ntry=7, one 32-block).

    Per block: weights ``x^2``; initial scale ``max/127`` (``max`` = signed
    absmax) and its least-squares refit; then 15 trial inverse scales
    ``(itry-127)/max`` for itry in -7..7, keeping the refit with the best
    ``sumqx^2/sumq2``; the final indices are re-picked with ``1/d``.  Blocks with
    ``amax < 1e-15`` get ``d = 0`` and every index 8 (the code nearest 0).
    """
    mx = _signed_absmax(x)
    amax = np.abs(mx)
    xt = np.ascontiguousarray(x.T)  # (32, M): contiguous rows for the sequential sums
    w = xt * xt
    with np.errstate(all="ignore"):

        def fit(iden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            # |id| <= 134/1e-15 for every block that is kept, so 2*id is exact
            q = _VAL_LUT.take(_best_index((iden * _F32(2))[None, :] * xt))
            wq = w * q
            return _seq_sum(wq * xt), _seq_sum(wq * q)

        d0 = -mx / _F32(-127)
        sumqx, sumq2 = fit(_F32(1) / d0)
        d = np.where(sumq2 > 0, sumqx / sumq2, _F32(0)).astype(_F32)
        best = d * sumqx
        for itry in range(-7, 8):
            sumqx, sumq2 = fit(_F32(itry - 127) / mx)
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            d = np.where(better, sumqx / sumq2, d).astype(_F32)
            best = np.where(better, d * sumqx, best).astype(_F32)
        d = np.where(amax < _F32(1e-15), _F32(0), d).astype(_F32)
        iden = _recip_or_zero(d)
        # 1/d is unbounded here, so double the product (2*id could overflow where id*x does not)
        idx = _IDX_LUT.take(_best_index(iden[None, :] * xt * _F32(2))).T
    out = np.empty((x.shape[0], 18), np.uint8)
    _put_u16(out, 0, fp32_to_fp16_bits(d))
    out[:, 2:] = _pack_nibbles(idx)
    return out


def _deq_iq4_nl(b: np.ndarray) -> np.ndarray:
    d = fp16_bits_to_fp32(_u16_le(b[:, 0], b[:, 1]))
    return _KV_F32[_unpack_nibbles(b[:, 2:])] * d[:, None]


_QUANT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    GGML_TYPE_Q4_0: _quant_q4_0,
    GGML_TYPE_Q4_1: _quant_q4_1,
    GGML_TYPE_Q5_0: _quant_q5_0,
    GGML_TYPE_Q5_1: _quant_q5_1,
    GGML_TYPE_Q8_0: _quant_q8_0,
    GGML_TYPE_IQ4_NL: _quant_iq4_nl,
}

_DEQUANT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    GGML_TYPE_Q4_0: _deq_q4_0,
    GGML_TYPE_Q4_1: _deq_q4_1,
    GGML_TYPE_Q5_0: _deq_q5_0,
    GGML_TYPE_Q5_1: _deq_q5_1,
    GGML_TYPE_Q8_0: _deq_q8_0,
    GGML_TYPE_IQ4_NL: _deq_iq4_nl,
}


def _map_blocks(
    fn: Callable[[np.ndarray], np.ndarray], blocks: np.ndarray, width: int, dtype: type
) -> np.ndarray:
    """Apply a block codec chunk by chunk so temporaries stay bounded on whole caches."""
    m = blocks.shape[0]
    out = np.empty((m, width), dtype)
    with np.errstate(all="ignore"):  # inf/NaN follow C semantics silently, as in ggml
        for s in range(0, m, _CHUNK_BLOCKS):
            out[s : s + _CHUNK_BLOCKS] = fn(blocks[s : s + _CHUNK_BLOCKS])
    return out


# --------------------------------------------------------------------------- public codecs


def dequantize(raw: np.ndarray, type_id: int, n: int) -> np.ndarray:
    """Decode rows of ``type_id`` into float32, exactly as ggml's ``to_float``.

    ``raw`` is uint8 with last dimension ``row_size(type_id, n)`` and any leading
    dimensions; the result has the same leading dimensions and last dimension ``n``.
    """
    t = _get_type(type_id)
    rs = row_size(type_id, n)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise TypeError(f"dequantize expects uint8 row bytes, got {raw.dtype}")
    if raw.ndim == 0 or raw.shape[-1] != rs:
        got = raw.shape[-1] if raw.ndim else "a scalar"
        raise StateLayoutError(f"{n} {t.name} values take {rs} bytes per row, got {got}")
    lead = raw.shape[:-1]
    flat = np.ascontiguousarray(raw).reshape(-1, t.type_size)
    if type_id == GGML_TYPE_F32:
        out = flat.view("<f4").astype(_F32)
    elif type_id == GGML_TYPE_F16:
        out = fp16_bits_to_fp32(flat.view("<u2").astype(np.uint16))
    elif type_id == GGML_TYPE_BF16:
        out = bf16_bits_to_fp32(flat.view("<u2").astype(np.uint16))
    else:
        out = _map_blocks(_DEQUANT[type_id], flat, t.block_size, _F32)
    return out.reshape(*lead, n)


def quantize(x: np.ndarray, type_id: int) -> np.ndarray:
    """Encode float32 rows (last dimension ``n``) as ``type_id`` row bytes.

    Bit-identical to ``ggml_quantize_chunk`` without an importance matrix, i.e.
    ``quantize_row_*_ref`` for q4_0/q4_1/q5_0/q5_1/q8_0, ``quantize_iq4_nl``
    (with its scale search) for iq4_nl, and ggml's fp16/bf16 row converters.
    Bit-exactness is what lets merges re-quantise deterministically and keeps a
    re-quantised kept row identical to the original.  Non-float32 input is
    first cast to float32 (as a caller of ggml would have to).

    Note that llama.cpp's CPU backend fills the cache through its own
    ``from_float``, which agrees with this everywhere except q8_0 on AVX (a
    SIMD routine: ``127/amax`` scaling and round-half-even, so roughly 1 block
    in 10^4 is one step off) and iq4_nl (``quantize_row_iq4_nl_ref``, which
    skips the scale search).  Blocks written that way still decode exactly
    with :func:`dequantize`.
    """
    t = _get_type(type_id)
    x = np.asarray(x, dtype=_F32)
    if x.ndim == 0:
        raise StateLayoutError("quantize needs at least one dimension (the row)")
    n = x.shape[-1]
    rs = row_size(type_id, n)
    lead = x.shape[:-1]
    flat = np.ascontiguousarray(x).reshape(-1, t.block_size)
    if type_id == GGML_TYPE_F32:
        out = flat.astype("<f4").view(np.uint8)
    elif type_id == GGML_TYPE_F16:
        out = fp32_to_fp16_bits(flat).astype("<u2").view(np.uint8)
    elif type_id == GGML_TYPE_BF16:
        out = fp32_to_bf16_bits(flat).astype("<u2").view(np.uint8)
    else:
        out = _map_blocks(_QUANT[type_id], flat, t.type_size, np.uint8)
    return out.reshape(*lead, rs)
