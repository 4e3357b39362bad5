"""edgekv's compiled host kernels over numpy arrays (``native/kernels.c``, wrapped by
cffi as ``edgekv._edgekv_kernels``). They need no llama.cpp, so a method's arithmetic runs
on them whichever engine holds the cache. Each kernel runs only where the CPU has what it
was written for; a caller that gets None keeps its numpy path, which computes the same."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

_UNSUPPORTED = -1


@dataclass(frozen=True)
class Screen:
    """What lets ``best_two`` skip pairs: the first r channels of the rows and of the
    prototypes in some orthonormal axes (``xa`` [n, r], ``pa`` [c, r]), bounds on the
    norms of their other channels (``rest_x`` [n], ``rest_p`` [c]) and, per row, a
    ``slack`` that covers the rounding of a screened product and of a full one."""

    xa: np.ndarray
    pa: np.ndarray
    rest_x: np.ndarray
    rest_p: np.ndarray
    slack: np.ndarray


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


def best_two(x: np.ndarray, protos: np.ndarray, *, screen: Screen | None = None,
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(top, second, arg) per row of ``x`` [n, d] against the rows of ``protos`` [c, d],
    both float32: ``arg`` the first prototype of largest float32 product, ``top`` that
    product, ``second`` the largest product of the others (``top`` again on a tie).

    With a ``screen``, a prototype whose screened product plus ``rest_x[i] * rest_p[j]``
    falls below row i's best product so far less ``slack[i]`` is skipped: left out of
    top, second and arg (``native/kernels.h`` says why the answer stands when the slack
    covers the rounding).

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
    pt = _padded_columns(protos, cp)
    ffi = m.ffi
    r, skip = 0, [ffi.NULL] * 5
    if screen is not None:
        r = screen.xa.shape[1]
        if screen.xa.shape != (n, r) or screen.pa.shape != (c, r) or screen.rest_x.shape != (n,) \
                or screen.rest_p.shape != (c,) or screen.slack.shape != (n,):
            raise ValueError(f"best_two: a screen of {n} rows and {c} prototypes does not fit "
                             f"{screen.xa.shape}, {screen.pa.shape}")
        rest_p = np.zeros(cp, np.float32)
        rest_p[:c] = screen.rest_p
        kept = [np.ascontiguousarray(screen.xa, np.float32), _padded_columns(screen.pa, cp),
                np.ascontiguousarray(screen.rest_x, np.float32), rest_p,
                np.ascontiguousarray(screen.slack, np.float32)]
        skip = [ffi.from_buffer("float[]", a) for a in kept]
    top, second, arg = np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.int32)
    got = m.lib.edgekv_best_two(ffi.from_buffer("float[]", x), n, d, ffi.from_buffer("float[]", pt), c, cp, r, *skip,
                                ffi.from_buffer("float[]", top), ffi.from_buffer("float[]", second),
                                ffi.from_buffer("int32_t[]", arg))
    if got == _UNSUPPORTED:
        return None
    if got < 0:
        raise MemoryError(f"edgekv_best_two failed ({got}) for {n} rows and {c} prototypes")
    return top, second, arg


def _padded_columns(rows: np.ndarray, cp: int) -> np.ndarray:
    """float32 [d, cp]: ``rows`` [c, d] transposed, zeros past column c (the kernel's tiles)."""
    out = np.zeros((rows.shape[1], cp), np.float32)
    out[:, : rows.shape[0]] = rows.T
    return out


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
