"""ggml's own codecs for the tensor types llama.cpp accepts as KV-cache types.

A llama.cpp sequence-state blob stores each layer's K and V rows in the cache's
ggml type (``--cache-type-k/-v``). edgekv edits those blobs: compaction gathers
a subset of cells, merging averages cells and writes the result back, the
re-rotation re-quantises keys. Those edits stay honest because the codecs here
are ggml's own, called in libggml-base (which llama-cpp-python ships next to
libllama):

* :func:`dequantize` runs the type's ``to_float``: the very floats the model sees;
* :func:`quantize` runs ``ggml_quantize_chunk`` (no importance matrix): the
  reference quantisers, so re-quantising is deterministic and a kept row that goes
  through ``quantize(dequantize(row))`` comes back unchanged for the scale/round
  types (``tests/test_quant.py``).

Each call converts a whole array in one foreign call. The type table (block and
type sizes, names) lives in ``ggml_types.py``; this module checks shapes and
types before anything reaches C, since ggml asserts (aborts) on a type it has no
quantiser for.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from functools import cache
from pathlib import Path

import numpy as np

from ..errors import EdgekvError, StateLayoutError
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
    "type_by_name",
    "row_size",
    "dequantize",
    "quantize",
    "ggml_base",
    "TypeTraits",
]


class TypeTraits(ctypes.Structure):
    """``struct ggml_type_traits`` (ggml/include/ggml.h), the fields up to ``from_float_ref``."""

    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


@cache
def ggml_base() -> ctypes.CDLL:
    """libggml-base from llama-cpp-python's library folder (the one libllama loads)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise EdgekvError("llama-cpp-python is not installed: run scripts/setup.sh")
    libdir = Path(spec.origin).parent / "lib"
    name = {"darwin": "libggml-base.dylib", "win32": "ggml-base.dll"}.get(sys.platform, "libggml-base.so")
    if not (libdir / name).is_file():
        raise EdgekvError(f"{libdir / name} is missing: llama-cpp-python's ggml libraries are incomplete")
    lib = ctypes.CDLL(str(libdir / name))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return lib


@cache
def _to_float(type_id: int) -> ctypes._CFuncPtr:
    return _TO_FLOAT(ggml_base().ggml_get_type_traits(type_id).contents.to_float)


def dequantize(raw: np.ndarray, type_id: int, n: int) -> np.ndarray:
    """Decode rows of ``type_id`` into float32 with ggml's ``to_float``.

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
    raw = np.ascontiguousarray(raw)
    if type_id == GGML_TYPE_F32:  # no converter: the bytes are the floats
        return raw.view("<f4").astype(np.float32).reshape(*lead, n)
    out = np.empty((*lead, n), np.float32)
    if out.size:
        _to_float(type_id)(raw.ctypes.data, out.ctypes.data, out.size)
    return out


def quantize(x: np.ndarray, type_id: int) -> np.ndarray:
    """Encode float32 rows (last dimension ``n``) as ``type_id`` row bytes with
    ``ggml_quantize_chunk``: ``quantize_row_*_ref`` for q4_0/q4_1/q5_0/q5_1/q8_0,
    ``quantize_iq4_nl`` (with its scale search) for iq4_nl, and ggml's fp16/bf16 row
    converters. Non-float32 input is first cast to float32 (as a caller of ggml must).

    llama.cpp's CPU backend fills the cache through its own ``from_float``, which
    agrees with this everywhere except q8_0 on x86 (a SIMD routine: ``127/amax``
    scaling and round-half-even, so about 1 block in 10^4 is one step off) and
    iq4_nl (``quantize_row_iq4_nl_ref``, which skips the scale search). Blocks written
    that way still decode exactly with :func:`dequantize`.
    """
    _get_type(type_id)
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0:
        raise StateLayoutError("quantize needs at least one dimension (the row)")
    n = x.shape[-1]
    rs = row_size(type_id, n)
    lead = x.shape[:-1]
    x = np.ascontiguousarray(x)
    out = np.empty((*lead, rs), np.uint8)
    rows = int(np.prod(lead, dtype=np.int64))
    if rows and n:
        written = ggml_base().ggml_quantize_chunk(type_id, x.ctypes.data, out.ctypes.data, 0, rows, n, None)
        if written != out.size:
            raise StateLayoutError(f"ggml wrote {written} bytes for {rows} rows of {rs}")
    return out
