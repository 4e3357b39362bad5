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
class BestTwo:
    """``best_two``'s answer per row: ``top`` the largest product, ``arg`` its first
    prototype, ``second`` the largest product of the others; with a screen, how many
    16-prototype halves it screened and how many of them ``passed`` (were computed)."""

    top: np.ndarray
    second: np.ndarray
    arg: np.ndarray
    screened: int = 0
    passed: int = 0


@cache
def _module():
    try:
        from . import _edgekv_kernels as m  # type: ignore[attr-defined]
    except ImportError:  # not built (no C compiler at setup): the numpy paths serve
        return None
    return m


def _runnable():
    """The built module where its kernels can run now (AVX-512 with VNNI, or AVX2 with FMA), else None."""
    m = _module()
    return None if m is None or m.lib.edgekv_kernel_isa() == _UNSUPPORTED else m


def isa() -> str | None:
    """The instruction set the kernels run now: "avx512" (AVX-512 with VNNI, not under
    ``EDGEKV_CPU=avx2``), "avx2" (AVX2 with FMA), or None (not built, or neither). Read at
    each call, so that ``EDGEKV_CPU`` set in a running process takes effect."""
    m = _runnable()
    if m is None:
        return None
    return {m.lib.EDGEKV_KERNEL_AVX2: "avx2", m.lib.EDGEKV_KERNEL_AVX512: "avx512"}[m.lib.edgekv_kernel_isa()]


def best_two(x: np.ndarray, protos: np.ndarray, *, axes: np.ndarray | None = None) -> BestTwo | None:
    """Each row of ``x`` [n, d] against the rows of ``protos`` [c, d], both float32:
    the first prototype of largest float32 product, that product, and the largest product
    of the others (``top`` again on a tie).

    With ``axes`` [d, r] (the float32 copy of r orthonormal columns, r a multiple of 4
    up to 32, d <= 256), prototypes are skipped on a screen: rows and prototypes in those
    axes, in bytes, give bounds on the products, and a prototype whose bound is below the
    row's best so far is left out (``native/kernels.h`` says why the answer stands).

    The products are summed in any order, so their rounding is the caller's to bound.
    None where the kernel cannot run: not built, or no AVX-512 with VNNI (``EDGEKV_CPU=avx2``
    acts as none) and no screen; the screened kernel runs on AVX2 with FMA too, with the
    screen in float32 instead of bytes.
    A row with a NaN or an infinity gets a top or second that is not finite, never a
    finite wrong answer; ``protos`` must be finite (the caller checks)."""
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
    screen = ffi.NULL
    if axes is not None:
        axes = np.ascontiguousarray(axes, np.float32)
        r = axes.shape[1] if axes.ndim == 2 else 0
        if axes.shape != (d, r) or not 4 <= r <= 32 or r % 4 or d > 256:
            raise ValueError(f"best_two: axes must be [{d}, r], r a multiple of 4 up to 32 (d <= 256), "
                             f"got {axes.shape}")
        screen = ffi.new("struct edgekv_screen *", [r, ffi.from_buffer("float[]", axes), 0, 0])
    top, second, arg = np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.int32)
    got = m.lib.edgekv_best_two(ffi.from_buffer("float[]", x), n, d, ffi.from_buffer("float[]", pt), c, cp, screen,
                                ffi.from_buffer("float[]", top), ffi.from_buffer("float[]", second),
                                ffi.from_buffer("int32_t[]", arg))
    if got == _UNSUPPORTED:
        return None
    if got < 0:
        raise MemoryError(f"edgekv_best_two failed ({got}) for {n} rows and {c} prototypes")
    if axes is None:
        return BestTwo(top, second, arg)
    return BestTwo(top, second, arg, int(screen.screened), int(screen.passed))


def _padded_columns(rows: np.ndarray, cp: int) -> np.ndarray:
    """float32 [d, cp]: ``rows`` [c, d] transposed, zeros past column c (the kernel's tiles)."""
    out = np.zeros((rows.shape[1], cp), np.float32)
    out[:, : rows.shape[0]] = rows.T
    return out


def irregularity(x: np.ndarray, bounds: np.ndarray) -> np.ndarray | None:
    """float64 [n]: ProtoKV's irregularity of each row of the float32 ``x`` [n, d] in its
    chunk (``methods.protokv.irregularity``, the same floats: numpy's sums in numpy's
    order). None where the kernel cannot run: not built, neither AVX-512 with VNNI nor AVX2
    with FMA, or a head size that numpy sums in more than one block (d < 8 or d > 128)."""
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


def expected_logits(x: np.ndarray, mu: np.ndarray, cov: np.ndarray, kq_scale: float) -> np.ndarray | None:
    """float64 [g, n]: Expected Attention's logits ``s mu_h . x_i + s^2 / 2 x_i^T C_h x_i``
    for every row of the float32 ``x`` [n, d] (one KV head's keys) and each of the g query
    heads of ``mu`` [g, d] and ``cov`` [g, d, d] (symmetric or not). The mean term in double,
    the quadratic form in float32 over each matrix's upper triangle (half numpy's
    multiply-adds), in the order ``native/kernels.h`` gives, on every CPU alike. None where
    the kernel cannot run (not built, or no AVX2 with FMA)."""
    m = _module()
    if m is None:
        return None
    if (x.dtype != np.float32 or x.ndim != 2 or mu.ndim != 2 or mu.shape[1] != x.shape[1]
            or cov.shape != (mu.shape[0], x.shape[1], x.shape[1])):
        raise ValueError(f"expected_logits takes float32 [n, d], [g, d] and [g, d, d], got {x.dtype} {x.shape}, "
                         f"{mu.shape}, {cov.shape}")
    x = np.ascontiguousarray(x)
    (n, d), g = x.shape, mu.shape[0]
    w = (cov + cov.transpose(0, 2, 1)).reshape(g, d * d)
    flat, diag = _triangle(d)
    w[:, diag] = cov.reshape(g, d * d)[:, diag]
    w = np.ascontiguousarray(w[:, flat].T, np.float32)  # [entry, g]: a step's g entries side by side
    mu = np.ascontiguousarray(mu, np.float64)
    logits = np.empty((g, n))
    ffi = m.ffi
    got = m.lib.edgekv_expected_logits(ffi.from_buffer("float[]", x), n, d, ffi.from_buffer("double[]", mu),
                                       ffi.from_buffer("float[]", w), g, kq_scale, 0.5 * kq_scale**2,
                                       ffi.from_buffer("double[]", logits))
    if got == _UNSUPPORTED:
        return None
    if got < 0:
        raise MemoryError(f"edgekv_expected_logits failed ({got}) for {n} rows of {d}")
    return logits


@cache
def _triangle(d: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices into [d, d] of the upper triangle row by row (the kernel's order), and
    of the diagonal."""
    rows, cols = np.triu_indices(d)
    return rows * d + cols, np.arange(d) * (d + 1)
