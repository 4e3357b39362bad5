"""edgekv's compiled host kernels over numpy arrays (``native/kernels.c``, wrapped by
cffi as ``edgekv._edgekv_kernels``). They need no llama.cpp, so a method's arithmetic runs
on them whichever engine holds the cache. Each kernel runs only where the CPU has what it
was written for; a caller that gets None keeps its numpy path, which computes the same."""

from __future__ import annotations

from functools import cache

import numpy as np

_UNSUPPORTED = -1


@cache
def _module():
    try:
        from . import _edgekv_kernels as m  # type: ignore[attr-defined]
    except ImportError:  # not built (no C compiler at setup): the numpy paths serve
        return None
    return m


def _runnable():
    """The built module where its kernels can run now (AVX-512, not EDGEKV_CPU=avx2), else None."""
    m = _module()
    return None if m is None or m.lib.edgekv_kernel_isa() == _UNSUPPORTED else m


def best_two(x: np.ndarray, protos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(top, second, arg) per row of ``x`` [n, d] against the rows of ``protos`` [c, d],
    both float32: ``arg`` the first prototype of largest float32 product, ``top`` that
    product, ``second`` the largest product of the others (``top`` again on a tie).

    The products are summed in any order, so their rounding is the caller's to bound.
    None where the kernel cannot run (not built, no AVX-512, ``EDGEKV_CPU=avx2``). A row
    with a NaN or an infinity gets a top or second that is not finite, never a finite
    wrong answer; ``protos`` must be finite (the caller checks)."""
    m = _runnable()
    if m is None:
        return None
    if x.dtype != np.float32 or protos.dtype != np.float32 or x.ndim != 2 or protos.shape[1:] != x.shape[1:]:
        raise ValueError(f"best_two takes float32 [n, d] and [c, d], got {x.dtype} {x.shape}, "
                         f"{protos.dtype} {protos.shape}")
    x = np.ascontiguousarray(x)
    n, d = x.shape
    c = protos.shape[0]
    cp = -(-c // 32) * 32  # the kernel's tiles are 32 prototypes wide
    pt = np.zeros((d, cp), np.float32)
    pt[:, :c] = protos.T
    top, second, arg = np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.int32)
    ffi = m.ffi
    got = m.lib.edgekv_best_two(ffi.from_buffer("float[]", x), n, d, ffi.from_buffer("float[]", pt), c, cp,
                                ffi.from_buffer("float[]", top), ffi.from_buffer("float[]", second),
                                ffi.from_buffer("int32_t[]", arg))
    if got == _UNSUPPORTED:
        return None
    if got < 0:
        raise MemoryError(f"edgekv_best_two failed ({got}) for {n} rows and {c} prototypes")
    return top, second, arg


def irregularity(x: np.ndarray, bounds: np.ndarray) -> np.ndarray | None:
    """float64 [n]: ProtoKV's irregularity of each row of the float32 ``x`` [n, d] in its
    chunk (``methods.protokv.irregularity``, the same floats: numpy's sums in numpy's
    order). None where the kernel cannot run: not built, no AVX-512, or a head size that
    numpy sums in more than one block (d < 8 or d > 128)."""
    m = _runnable()
    if m is None:
        return None
    if x.dtype != np.float32 or x.ndim != 2:
        raise ValueError(f"irregularity takes float32 [n, d], got {x.dtype} {x.shape}")
    x = np.ascontiguousarray(x)
    bounds = np.ascontiguousarray(bounds, np.int64)
    n, d = x.shape
    delta = np.empty(n, np.float64)
    ffi = m.ffi
    got = m.lib.edgekv_irregularity(ffi.from_buffer("float[]", x), n, d, ffi.from_buffer("int64_t[]", bounds),
                                    bounds.size - 1, ffi.from_buffer("double[]", delta))
    if got == _UNSUPPORTED:
        return None
    if got < 0:
        raise ValueError(f"edgekv_irregularity refused {n} rows in chunks {bounds.tolist()[:4]}... ({got})")
    return delta
