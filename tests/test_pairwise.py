"""The compiled pairwise sums against numpy's own: scorers that fuse their passes into
numba kernels rely on them to keep numpy's floats (and so the kept cells) unchanged."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from edgekv.methods.pairwise import sum_products, sum_squares, sum_squares_own

LENGTHS = [*range(0, 300), 383, 511, 512, 513, 576, 1000, 4097, 100_003]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sums_are_numpys_floats(dtype) -> None:
    # numpy adds blocks of 128 with eight partial sums and halves longer runs at a multiple
    # of eight: every length below, across those edges, with offsets into a flat array
    rng = np.random.default_rng(7)
    for n in LENGTHS:
        a = (rng.standard_normal(n + 5) * np.exp2(rng.uniform(-20, 20, n + 5))).astype(dtype)
        b = rng.standard_normal(n + 5).astype(dtype)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        assert sum_squares(a, 3, n) == np.add.reduce(a64[3 : 3 + n] ** 2), n
        assert sum_products(a, 5, b, 2, n) == np.add.reduce(a64[5 : 5 + n] * b64[2 : 2 + n]), n
        # in the array's own type: float32 squares summed in float32, as numpy sums them
        assert sum_squares_own(a, 1, n) == np.add.reduce(a[1 : 1 + n] * a[1 : 1 + n]), n


def test_a_second_process_loads_the_cached_kernels() -> None:
    # numba caches compiled code beside the module; a cached recursive kernel crashed the
    # next process that loaded it, so the long-run sum walks its halves without recursion
    code = ("import numpy as np; from edgekv.methods.pairwise import sum_squares as f; "
            "x = np.arange(1000.0); assert f(x, 0, 1000) == np.add.reduce(x * x)")
    for _ in range(2):
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
