"""edgekv's SnapKV and ChunkKV (per-layer mode) keep what kvpress keeps, on identical inputs.

``tests/data/kvpress_fixture.npz`` was written by ``bench/kvpress_fixture.py``
with kvpress 0.5.5 itself (torch, transformers): three random Llama attention
layers (6 query heads on 2 KV heads, head size 16, 200 tokens), the window's
post-RoPE queries as kvpress computes them, the keys, and the positions
kvpress's ``SnapKVPress`` (window 64, kernel 5) and ``ChunkKVPress`` (chunk
20 over it) keep at ratios 0.5 and 0.6. No torch here: edgekv runs on the
same numbers and must keep the same cells (random floats: no ties).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgekv.kvcache.queries import QueryWindow
from edgekv.kvcache.snapshot import KVSnapshot
from edgekv.methods import get_method

FIXTURE = Path(__file__).parent / "data" / "kvpress_fixture.npz"


def load() -> tuple[KVSnapshot, dict]:
    f = dict(np.load(FIXTURE))
    n, window, _, _ = (int(x) for x in f["meta"])
    q, k, v = f["q"], f["k"], f["v"]
    win = QueryWindow(window, tuple(range(q.shape[0])), q, np.arange(n - window, n, dtype=np.int32))
    return KVSnapshot.from_arrays(list(k), list(v), queries=win), f


def test_fixture_was_written_by_kvpress() -> None:
    _, f = load()
    assert str(f["versions"][0]).startswith("kvpress 0.5")


@pytest.mark.parametrize("ratio", [0.5, 0.6])
def test_snapkv_keeps_kvpress_snapkv_cells(ratio: float) -> None:
    snap, f = load()
    n, window, kernel, _ = (int(x) for x in f["meta"])
    keep = get_method("snapkv", window=window, kernel=kernel).select(snap, int(n * (1 - ratio)))
    for layer in range(snap.n_layer):
        want = f[f"snapkv_{ratio}_layer{layer}"]
        assert np.array_equal(keep[layer], want), layer


@pytest.mark.parametrize("ratio", [0.5, 0.6])
def test_chunkkv_per_layer_keeps_kvpress_chunks(ratio: float) -> None:
    snap, f = load()
    n, window, kernel, chunk = (int(x) for x in f["meta"])
    m = get_method("chunkkv", window=window, kernel=kernel, chunk=chunk, per_layer=True)
    for layer in range(snap.n_layer):
        want = f[f"chunkkv_{ratio}_layer{layer}"]
        assert np.all(want == want[0])  # kvpress: one chunk set for every head of the layer
        keep = m.select(snap, want.shape[1])
        assert np.array_equal(keep[layer], want), layer
