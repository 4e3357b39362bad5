"""numpy's pairwise float64 sums, compiled, for scorers that fuse their passes.

A scorer that moves a norm from numpy into a numba kernel must add in numpy's order,
or a score moves in its last bit and a kept cell can move with it. numpy's
``add.reduce`` over a contiguous run of ``n`` doubles (``np.linalg.norm(x, axis=-1)``,
``x.sum(axis=-1)``) adds blocks of up to 128 with eight interleaved partial sums
(sequentially below eight) and splits longer runs in two at a multiple of eight.
These functions reproduce that order exactly (``tests/test_pairwise.py``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

_BLOCK = 128  # numpy's PW_BLOCKSIZE


@njit(cache=True, nogil=True, inline="always")
def _mul(a, i, b, j):  # pragma: no cover - compiled
    return np.float64(a[i]) * np.float64(b[j])


@njit(cache=True, nogil=True, inline="always")
def _block_sum_products(a, alo, b, blo, n):  # pragma: no cover - compiled
    """One block (n <= 128) of numpy's pairwise sum of a[alo:alo+n] * b[blo:blo+n] in
    float64: eight interleaved partial sums, sequential below eight."""
    if n < 8:
        s = 0.0
        for m in range(n):
            s += _mul(a, alo + m, b, blo + m)
        return s
    r0, r1, r2, r3 = _mul(a, alo, b, blo), _mul(a, alo + 1, b, blo + 1), _mul(a, alo + 2, b, blo + 2), _mul(a, alo + 3, b, blo + 3)
    r4, r5, r6, r7 = _mul(a, alo + 4, b, blo + 4), _mul(a, alo + 5, b, blo + 5), _mul(a, alo + 6, b, blo + 6), _mul(a, alo + 7, b, blo + 7)
    m = 8
    while m + 8 <= n:
        i, j = alo + m, blo + m
        r0 += _mul(a, i, b, j)
        r1 += _mul(a, i + 1, b, j + 1)
        r2 += _mul(a, i + 2, b, j + 2)
        r3 += _mul(a, i + 3, b, j + 3)
        r4 += _mul(a, i + 4, b, j + 4)
        r5 += _mul(a, i + 5, b, j + 5)
        r6 += _mul(a, i + 6, b, j + 6)
        r7 += _mul(a, i + 7, b, j + 7)
        m += 8
    s = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while m < n:
        s += _mul(a, alo + m, b, blo + m)
        m += 1
    return s


@njit(cache=True, nogil=True)
def _long_sum_products(a, alo, b, blo, n):  # pragma: no cover - compiled
    """numpy's recursion for runs above a block (halve at a multiple of eight, add the
    halves' sums), walked with an explicit stack: numba's cache cannot hold a recursive
    function (a cached one crashes the next process)."""
    start = np.empty(64, np.int64)  # a frame: the run start:start+size, its left half's sum
    size = np.empty(64, np.int64)
    left = np.empty(64)
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
        s = _block_sum_products(a, alo + start[top], b, blo + start[top], size[top])
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
def sum_products(a, alo, b, blo, n):  # pragma: no cover - compiled
    """float64: ``np.add.reduce(a[alo:alo+n] * b[blo:blo+n])`` with both in float64, numpy's
    float (a and b one-dimensional: flat views of contiguous rows)."""
    if n <= _BLOCK:  # the usual head sizes: one block, inlined into the caller's loop
        return _block_sum_products(a, alo, b, blo, n)
    return _long_sum_products(a, alo, b, blo, n)


@njit(cache=True, nogil=True, inline="always")
def sum_squares(x, lo, n):  # pragma: no cover - compiled
    """float64: ``np.add.reduce(x[lo:lo+n].astype(np.float64) ** 2)``, numpy's float: the
    square of a norm (``np.linalg.norm`` squares in float64 and adds this way)."""
    return sum_products(x, lo, x, lo, n)
