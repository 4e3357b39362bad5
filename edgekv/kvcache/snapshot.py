"""What a method sees of the cache: a snapshot, a plain data view of one sequence.

``KVSnapshot`` holds the cells' positions, the token each (layer, KV head, cell)
holds, the observation window, the tally and the merge counts, and hands out each
layer's dequantised keys and values on demand. Where those come from is the only
thing that differs between engines, so each engine subclasses it and fills in
``_load``: ``HostSnapshot`` (below) dequantises the state engine's parsed blob, the
native engine's snapshot (``native.py``) reads through its device ops.

An engine may also do some of a method's arithmetic where the cache lives. Those
accelerators are named in ``accelerators`` and override the host versions here,
which compute the same numbers:

- ``"key_norms"``: every key's norm summed on the device (no K read back);
- ``"window_attention"``: observation-window attention scored on the device;
- ``"lag_scores"``: LagKV's scores computed in the cache's memory;
- ``"value_norms"``: every value's norm computed in the cache's memory (no V read back).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import ClassVar

import numpy as np
from numba import njit

from ..errors import EdgekvError
from . import layout
from .quant import dequantize
from .queries import QueryMoments, QueryWindow, window_attention


@dataclass
class KVSnapshot:
    """Dequantised keys/values of one sequence's compressible cache.

    Cells are in position order. ``token_pos[l, h, j]`` is the original
    position of the token whose K/V sit in cell ``j`` of (layer ``l``, head
    ``h``): after a compaction, cell j holds different tokens in different
    heads (docs/design.md section 1). ``pos`` is llama.cpp's per-cell
    position, which only drives masking. Keys and values are returned as the
    model computed them: llama.cpp's Hadamard rotation of quantised caches is
    undone here, so scorers see the same channels whatever the cache type.

    This base class holds its layers in memory (``from_arrays``: tests, benchmarks
    and the papers' test vectors); methods cannot tell it from a snapshot of
    llama.cpp's cache.
    """

    accelerators: ClassVar[frozenset[str]] = frozenset()

    pos: np.ndarray
    token_pos: np.ndarray
    n_kv_head: int
    head_dim_k: int
    head_dim_v: int
    # the observation window (queries of the newest tokens) when the engine records one
    queries: QueryWindow | None = None
    kq_scale: float = 0.0
    # H2O's accumulated attention per (layer, KV head, cell), when the engine tallies it
    tally: np.ndarray | None = None
    # statistics of every recorded query before RoPE (Expected Attention), when the engine keeps them
    moments: QueryMoments | None = None
    # KVzip's scores per (layer, KV head, cell): the most attention each cell got while the
    # model repeated the context (set by ``KVzip.compress`` from its reconstruction pass)
    reconstruction: np.ndarray | None = None
    # how many tokens each (layer, KV head, cell) stands for (merging methods), float32
    # [n_layer, n_kv_head, n_cells]; None: one each. ``bias``: attention adds log(counts)
    counts: np.ndarray | None = None
    bias: bool = False
    scored_layers: list[int] = field(default_factory=list, repr=False)  # in the order they were scored
    _k: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    _v: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    _attn: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, repr=False)
    _sqn: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    _windows: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)
    # one caller at a time into the engine: a scorer may score several layers at once
    # (``ScorerMethod.parallel``), and llama.cpp's ops and the read buffers are not reentrant
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    @classmethod
    def from_arrays(cls, keys: list[np.ndarray], values: list[np.ndarray],
                    token_pos: np.ndarray | None = None, queries: QueryWindow | None = None,
                    kq_scale: float = 0.0, tally: np.ndarray | None = None,
                    counts: np.ndarray | None = None, reconstruction: np.ndarray | None = None,
                    moments: QueryMoments | None = None) -> KVSnapshot:
        """A snapshot of given float K/V ([n, H, d] per layer)."""
        n, h, dk = keys[0].shape
        dv = values[0].shape[2]
        if token_pos is None:
            token_pos = np.broadcast_to(np.arange(n, dtype=np.int32), (len(keys), h, n)).copy()
        return cls(pos=np.arange(n, dtype=np.int32), token_pos=token_pos, n_kv_head=h, head_dim_k=dk,
                   head_dim_v=dv, queries=queries, kq_scale=kq_scale or 1.0 / np.sqrt(dk), tally=tally,
                   reconstruction=reconstruction, moments=moments,
                   counts=None if counts is None else np.asarray(counts, np.float32),
                   _k={i: np.asarray(k, np.float32) for i, k in enumerate(keys)},
                   _v={i: np.asarray(v, np.float32) for i, v in enumerate(values)})

    @property
    def n_cells(self) -> int:
        return int(self.pos.shape[0])

    @property
    def n_layer(self) -> int:
        return int(self.token_pos.shape[0])

    # -- what an engine's subclass provides ------------------------------------
    def _load(self, layer: int, keys: bool, values: bool) -> None:
        """Put ``layer``'s keys (``keys``) and values (``values``) into ``_k`` / ``_v``
        ([n_cells, n_kv_head, head_dim], unrotated, position order); an engine may bring
        further layers along."""
        raise EdgekvError(f"this snapshot holds no layer {layer}")

    def _stored_keys(self, layer: int) -> np.ndarray:
        """float32 [n_cells, n_kv_head, head_dim_k] as the cache holds them (rotated
        when llama.cpp rotates them): what ``key_norms`` sums, so both engines agree."""
        return self.keys(layer)

    def _key_sqnorms(self, layer: int) -> None:
        """Put ``layer``'s (or every layer's) [n_kv_head, n_cells] key sums of squares into ``_sqn``."""
        self._sqn[layer] = key_sqnorms(self._stored_keys(layer)).T

    def _attention(self, layer: int, q: np.ndarray, q_pos: np.ndarray) -> np.ndarray:
        """[n_kv_head, n_cells]: the attention queries ``q`` [n_layer, n_head, n_q, d] at
        ``q_pos`` pay to ``layer``'s cells, summed per KV head (``queries.window_attention``)."""
        return window_attention(q[layer], q_pos, self.keys(layer), self.pos, self.kq_scale, self.log_counts(layer))

    def _attention_layers(self, layers: list[int], q: np.ndarray, q_pos: np.ndarray) -> list[np.ndarray]:
        """``_attention`` of each of ``layers``; an engine that scores several layers in one
        call overrides this."""
        return [self._attention(layer, q, q_pos) for layer in layers]

    def lag_scores(self, members: np.ndarray) -> np.ndarray | None:
        """LagKV's scores, K plus V, of groups of cells, each group against the next one,
        computed where the cache lives without reading K and V out: members int
        [n_layer, n_kv_head, G + 1, W] (ordinals in position order, a group ending at its
        first -1) -> float64 [n_layer, n_kv_head, G, W], padding -inf. None where the engine
        cannot (no ``"lag_scores"`` accelerator, or a cache llama.cpp rotates or keeps off
        the host): the method then scores ``keys`` and ``values`` itself, to the same doubles."""
        return None

    def value_norms(self, layer: int) -> np.ndarray | None:
        """float64 [n_cells, n_kv_head]: the L2 norm of every value of ``layer``, computed
        where the cache lives without reading V out, numpy's floats (``np.linalg.norm`` of the
        values as float64). None where the engine cannot (no ``"value_norms"`` accelerator,
        or a cache off the host): the method then norms ``values`` itself."""
        return None

    def release(self, layer: int) -> None:
        """Forget ``layer``'s K and V: a scorer done with them calls it. An engine's snapshot
        reads them again if asked, and meanwhile a native read's buffer serves the next
        layers instead of fresh pages (at 8k cells, page faults cost more than the read). K
        and V given to ``from_arrays`` cannot be read again, so this base keeps them."""

    # -- what methods read -------------------------------------------------------
    def prefetch(self, layer: int, values: bool = False) -> None:
        """Bring ``layer``'s K (and V) from the engine without handing them out: a parallel
        scorer's reading thread calls it, so that an engine which converts what it read
        (the native one puts cells out of order in position order) leaves that work to the
        scoring threads."""
        if values:
            self.values(layer)
        self.keys(layer)

    def keys(self, layer: int) -> np.ndarray:
        """float32 [n_cells, n_kv_head, head_dim_k] (post-RoPE, as cached)."""
        with self._lock:
            if layer not in self._k:
                self._load(layer, True, False)  # keys only: scorers rarely need values
            return self._k[layer]

    def values(self, layer: int) -> np.ndarray:
        """float32 [n_cells, n_kv_head, head_dim_v]."""
        with self._lock:
            if layer not in self._v:
                self._load(layer, layer not in self._k, True)  # K once only
            return self._v[layer]

    def key_norms(self, layer: int) -> np.ndarray:
        """float32 [n_kv_head, n_cells]: the L2 norm of every cached key.

        Taken over the keys as stored (a rotation preserves the norm) as float32 sums of
        squares (``key_sqnorms``), so a device's sums and the host's are the same floats
        and both engines rank near-ties alike."""
        with self._lock:
            if layer not in self._sqn:
                self._key_sqnorms(layer)
            return np.sqrt(self._sqn[layer])

    def log_counts(self, layer: int) -> np.ndarray | None:
        """The bias attention adds to ``layer``'s logits: log(counts) when the engine applies it."""
        return np.log(self.counts[layer]) if self.bias and self.counts is not None else None

    def _window(self, n_queries: int) -> tuple[np.ndarray, np.ndarray]:
        """The newest ``n_queries`` window queries, gathered once per snapshot: a scorer asks
        layer by layer, and each gather copies every layer's queries."""
        if self.queries is None:
            raise EdgekvError("this method needs the observation window (queries), which the "
                              "engine is not recording")
        if n_queries not in self._windows:
            self._windows[n_queries] = self.queries.last(n_queries)
        return self._windows[n_queries]

    def window_attention(self, layer: int, n_queries: int) -> np.ndarray:
        """float64 [n_kv_head, n_cells]: the attention the newest ``n_queries`` window
        queries pay to each cell, summed over them and over each KV head's query heads
        (``queries.window_attention``). Computed once per layer and kept;
        ``scored_layers`` records which layers paid for it."""
        with self._lock:
            self.prefetch_window_attention(n_queries, [layer])
            return self._attn[(layer, n_queries)]

    def prefetch_window_attention(self, n_queries: int, layers: Sequence[int] | None = None) -> None:
        """Score ``layers`` (default: every layer) for ``window_attention`` in one engine call
        where the engine can: the device op then shares all their heads out over its threads
        and sets up once, where a call per layer paid its set-up thirty times (ProtoKV at 8k
        cells: 0.11 s against 0.18 to 0.20 s). The same floats as layer by layer."""
        with self._lock:
            todo = [layer for layer in (range(self.n_layer) if layers is None else layers)
                    if (layer, n_queries) not in self._attn]
            if not todo:
                return
            q, q_pos = self._window(n_queries)
            for layer, a in zip(todo, self._attention_layers(todo, q, q_pos), strict=True):
                self._attn[(layer, n_queries)] = np.asarray(a, np.float64)
                self.scored_layers.append(layer)

    def head_attention(self, layer: int, n_queries: int, heads: list[int]) -> np.ndarray:
        """float64 [len(heads), n_cells]: like ``window_attention`` for single query heads
        (CompressKV's retrieval heads), each summed over the newest ``n_queries`` queries
        only. With the ``"window_attention"`` accelerator they are scored on the device,
        one query head per KV head per call."""
        with self._lock:
            return self._head_attention(layer, n_queries, heads)

    def _head_attention(self, layer: int, n_queries: int, heads: list[int]) -> np.ndarray:
        q, q_pos = self._window(n_queries)
        n_head = q.shape[1]
        group = n_head // self.n_kv_head
        if any(not 0 <= h < n_head for h in heads):
            raise EdgekvError(f"query heads must be in 0..{n_head - 1}, got {heads}")
        out = np.zeros((len(heads), self.n_cells))
        if "window_attention" not in self.accelerators:
            k = self.keys(layer)
            for i, h in enumerate(heads):
                g = h // group
                out[i] = window_attention(q[layer, h : h + 1], q_pos, k[:, g : g + 1], self.pos, self.kq_scale)[0]
            return out
        # rounds of one query head per KV head (rows of unused KV heads are ignored)
        todo = list(enumerate(heads))
        while todo:
            taken: dict[int, tuple[int, int]] = {}
            rest = []
            for i, h in todo:
                if h // group in taken:
                    rest.append((i, h))
                else:
                    taken[h // group] = (i, h)
            qr = np.zeros((q.shape[0], self.n_kv_head) + q.shape[2:], np.float32)
            for g, (_, h) in taken.items():
                qr[layer, g] = q[layer, h]
            a = self._attention(layer, qr, q_pos)
            for g, (i, _) in taken.items():
                out[i] = a[g]
            todo = rest
        return out


@dataclass
class HostSnapshot(KVSnapshot):
    """The state engine's snapshot: layers dequantised from the parsed state blob on demand."""

    section: layout.CacheSection = field(kw_only=True, repr=False)
    order: np.ndarray = field(kw_only=True, repr=False)  # cell ordinals in position order
    k_rot: int = field(kw_only=True, default=0, repr=False)  # llama.cpp's Hadamard block, 0: none
    v_rot: int = field(kw_only=True, default=0, repr=False)

    def release(self, layer: int) -> None:
        self._k.pop(layer, None)  # dequantised again from the blob if asked
        self._v.pop(layer, None)

    def _load(self, layer: int, keys: bool, values: bool) -> None:
        ld = self.section.layers[layer]
        if keys:
            k = unrotate(dequantize(ld.k, ld.k_type, self.n_kv_head * self.head_dim_k)[self.order], self.k_rot)
            self._k[layer] = k.reshape(self.n_cells, self.n_kv_head, self.head_dim_k)
        if values:
            raw = ld.v
            if self.section.v_trans:
                # [n_embd_v, n, el] -> [n, n_embd_v * el]: rows of one cell.
                raw = np.ascontiguousarray(raw.transpose(1, 0, 2)).reshape(self.n_cells, -1)
            v = unrotate(dequantize(raw, ld.v_type, self.n_kv_head * self.head_dim_v)[self.order], self.v_rot)
            self._v[layer] = v.reshape(self.n_cells, self.n_kv_head, self.head_dim_v)

    def _stored_keys(self, layer: int) -> np.ndarray:
        if not self.k_rot:
            return self.keys(layer)
        ld = self.section.layers[layer]
        k = dequantize(ld.k, ld.k_type, self.n_kv_head * self.head_dim_k)[self.order]
        return k.reshape(self.n_cells, self.n_kv_head, self.head_dim_k)


def key_sqnorms(x: np.ndarray) -> np.ndarray:
    """float32 sums of squares over the last axis, computed as ggml's CPU backend does
    (``sqr`` then ``sum_rows``): float32 squares added in order in float64, rounded
    once to float32."""
    x = np.asarray(x, np.float32)
    acc = np.zeros(x.shape[:-1], np.float64)
    for j in range(x.shape[-1]):  # in channel order; np.sum would add in pairs
        acc += np.square(x[..., j], dtype=np.float32)
    return acc.astype(np.float32)


@cache
def hadamard(n: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix exactly as llama.cpp builds it (float32, H @ H = I);
    built once per size and read-only."""
    h = np.array([[1.0 / np.sqrt(np.float32(n))]], dtype=np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    h.flags.writeable = False
    return h


def unrotate(x: np.ndarray, block: int) -> np.ndarray:
    """Undo llama.cpp's Walsh-Hadamard rotation of quantised caches (H is its own inverse)
    on ``x`` [..., channels], each run of ``block`` channels one rotated block; ``block``
    0: not rotated. float32 out.

    Computed as one exact recipe rather than a matrix product, so that every CPU and
    the native ops that unrotate (``llama_edgekv_seq_read``, ``_lag_scores``) get the
    same floats: the fast Walsh-Hadamard butterflies in float64 (sums of +-x, exact for
    dequantised q8_0/q4_0 rows in all but extreme scale spreads), then one
    multiplication by 1/sqrt(block) and one rounding to float32. A BLAS float32 product
    rounds at every step, in an order that differs between OpenBLAS's AMD and Intel
    kernels."""
    if not block:
        return x
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, block)
    out = np.empty_like(rows)
    _unrotate_rows(rows, out)
    return out.reshape(x.shape)


_UNROTATE_TILE = 32  # rows butterflied together: the innermost loop runs over them (SIMD lanes)


@njit(cache=True, nogil=True)
def _unrotate_rows(x, out):  # pragma: no cover - compiled
    """out[i] = x[i] @ H for float32 rows x [n, block]: H x by butterflies (a, b) -> (a + b,
    a - b) with the stride 1, 2, 4, ... in float64, then times 1/sqrt(block), rounded
    once. Tiles of rows are held channel-major so that each butterfly is a run of lanes;
    every element still sees the same operations in the same order."""
    n, block = x.shape
    scale = 1.0 / np.sqrt(np.float64(block))
    t = np.empty((block, _UNROTATE_TILE))
    for r0 in range(0, n, _UNROTATE_TILE):
        m = min(_UNROTATE_TILE, n - r0)
        for i in range(m):
            for c in range(block):
                t[c, i] = x[r0 + i, c]
        h = 1
        while h < block:
            for j0 in range(0, block, 2 * h):
                for j in range(j0, j0 + h):
                    for i in range(m):
                        a = t[j, i]
                        b = t[j + h, i]
                        t[j, i] = a + b
                        t[j + h, i] = a - b
            h *= 2
        for i in range(m):
            for c in range(block):
                out[r0 + i, c] = np.float32(t[c, i] * scale)
