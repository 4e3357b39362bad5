"""numpy's pairwise sums, compiled, for scorers that fuse their passes.

A scorer that moves a norm from numpy into a numba kernel must add in numpy's order,
or a score moves in its last bit and a kept cell can move with it. numpy's
``add.reduce`` over a contiguous run of ``n`` numbers (``np.linalg.norm(x, axis=-1)``,
``x.sum(axis=-1)``) adds blocks of up to 128 with eight interleaved partial sums
(sequentially below eight) and splits longer runs in two at a multiple of eight, in
the array's own type: float32 arrays are summed in float32. These functions reproduce
that order exactly (``tests/test_pairwise.py``).

numba's cache keys a compiled kernel by its own file: a kernel elsewhere that calls
these carries a copy of them, and editing this file alone leaves that copy in use. After
a change here, delete the callers' cached kernels (``__pycache__/*.nbi`` and ``*.nbc``
beside protokv.py, chelsea.py and expected_attention.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

_BLOCK = 128  # numpy's PW_BLOCKSIZE


def _mul(a, i, b, j, zero):
    """a[i] * b[j] in the type of ``zero`` (float64 or float32), compiled only."""
    raise NotImplementedError


@overload(_mul, inline="always")
def _mul_typed(a, i, b, j, zero):  # pragma: no cover - compiled
    # one body per accumulator type, chosen when numba compiles the caller (a function
    # passed as an argument instead would keep the kernels out of numba's cache)
    if isinstance(zero, types.Float) and zero.bitwidth == 32:
        return lambda a, i, b, j, zero: np.float32(a[i]) * np.float32(b[j])
    return lambda a, i, b, j, zero: np.float64(a[i]) * np.float64(b[j])


@njit(cache=True, nogil=True, inline="always")
def _block(zero, a, alo, b, blo, n):  # pragma: no cover - compiled
    """One block (n <= 128) of numpy's pairwise sum of _mul(a, alo + m, b, blo + m, zero):
    eight interleaved partial sums, sequential below eight."""
    if n < 8:
        s = zero
        for m in range(n):
            s += _mul(a, alo + m, b, blo + m, zero)
        return s
    r0, r1, r2, r3 = _mul(a, alo, b, blo, zero), _mul(a, alo + 1, b, blo + 1, zero), _mul(a, alo + 2, b, blo + 2, zero), _mul(a, alo + 3, b, blo + 3, zero)
    r4, r5, r6, r7 = _mul(a, alo + 4, b, blo + 4, zero), _mul(a, alo + 5, b, blo + 5, zero), _mul(a, alo + 6, b, blo + 6, zero), _mul(a, alo + 7, b, blo + 7, zero)
    m = 8
    while m + 8 <= n:
        i, j = alo + m, blo + m
        r0 += _mul(a, i, b, j, zero)
        r1 += _mul(a, i + 1, b, j + 1, zero)
        r2 += _mul(a, i + 2, b, j + 2, zero)
        r3 += _mul(a, i + 3, b, j + 3, zero)
        r4 += _mul(a, i + 4, b, j + 4, zero)
        r5 += _mul(a, i + 5, b, j + 5, zero)
        r6 += _mul(a, i + 6, b, j + 6, zero)
        r7 += _mul(a, i + 7, b, j + 7, zero)
        m += 8
    s = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while m < n:
        s += _mul(a, alo + m, b, blo + m, zero)
        m += 1
    return s


@njit(cache=True, nogil=True)
def _long(zero, a, alo, b, blo, n):  # pragma: no cover - compiled
    """numpy's recursion for runs above a block (halve at a multiple of eight, add the
    halves' sums), walked with an explicit stack: numba's cache cannot hold a recursive
    function (a cached one crashes the next process)."""
    start = np.empty(64, np.int64)  # a frame: the run start:start+size, its left half's sum
    size = np.empty(64, np.int64)
    left = np.full(64, zero)
    right_next = np.zeros(64, np.bool_)  # the left half is summed, the right one is next
    top = 0
    start[0], size[0] = 0, n
    while True:
        if size[top] > _BLOCK:  # descend into the left half
            half = size[top] // 2
            half -= half % 8
            start[top + 1], size[top + 1], right_next[top + 1] = start[top], half, False
            top += 1
            continue
        s = _block(zero, a, alo + start[top], b, blo + start[top], size[top])
        while True:  # hand the sum up: a left half waits for its right one, a right half completes its parent
            if top == 0:
                return s
            top -= 1
            if not right_next[top]:
                left[top] = s
                right_next[top] = True
                half = size[top] // 2
                half -= half % 8
                start[top + 1], size[top + 1], right_next[top + 1] = start[top] + half, size[top] - half, False
                top += 1
                break
            s = left[top] + s


@njit(cache=True, nogil=True, inline="always")
def _sum(zero, a, alo, b, blo, n):  # pragma: no cover - compiled
    if n <= _BLOCK:  # the usual head sizes: one block, inlined into the caller's loop
        return _block(zero, a, alo, b, blo, n)
    return _long(zero, a, alo, b, blo, n)


@njit(cache=True, nogil=True, inline="always")
def sum_products(a, alo, b, blo, n):  # pragma: no cover - compiled
    """float64: ``np.add.reduce(a[alo:alo+n] * b[blo:blo+n])`` with both in float64, numpy's
    float (a and b one-dimensional: flat views of contiguous rows)."""
    return _sum(0.0, a, alo, b, blo, n)


@njit(cache=True, nogil=True, inline="always")
def sum_squares(x, lo, n):  # pragma: no cover - compiled
    """float64: ``np.add.reduce(x[lo:lo+n].astype(np.float64) ** 2)``, numpy's float: the
    square of a norm (``np.linalg.norm`` squares in float64 and adds this way)."""
    return _sum(0.0, x, lo, x, lo, n)


def _zero_like(x):
    """0 in the type numpy sums ``x``'s squares in, compiled only."""
    raise NotImplementedError


@overload(_zero_like, inline="always")
def _zero_like_typed(x):  # pragma: no cover - compiled
    if isinstance(x, types.Array) and x.dtype == types.float32:
        return lambda x: np.float32(0.0)
    return lambda x: 0.0


@njit(cache=True, nogil=True, inline="always")
def sum_squares_own(x, lo, n):  # pragma: no cover - compiled
    """``np.add.reduce(x[lo:lo+n] * x[lo:lo+n])`` in x's own type, numpy's number: a
    float32 array squared and summed in float32 (``np.linalg.norm`` of float32 keys),
    others in float64."""
    return _sum(_zero_like(x), x, lo, x, lo, n)
