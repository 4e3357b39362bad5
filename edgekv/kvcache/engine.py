"""The KV engine protocol and the portable state engine.

An engine is the few verbs edgekv needs from a llama.cpp KV cache, in the
spirit of mlx-lm's cache objects:

- ``snapshot()``: the sequence's keys/values as float32, in position order,
  with the original token each (layer, KV head, cell) holds;
- ``compact(keep)``: keep, per (layer, KV head), the given cells (same count
  B for all), gathered into cells 0..B-1; everything else is freed;
- ``save()`` / ``restore(state)``: the whole sequence, to branch or reuse a prefill;
- ``n_cells``: cells held now.

Two implementations: ``StateEngine`` (here; any stock libllama, through the
per-sequence state API) and the native engine (the ggml patch set, same
verbs, done where the cache lives). Both must leave identical caches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..errors import EdgekvError
from . import layout
from .quant import dequantize
from .queries import AttentionTally, QueryWindow, window_attention

READ_BYTES = 32 << 20  # float32 K+V one native read brings back at most (its device output buffer)


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
    """

    pos: np.ndarray
    token_pos: np.ndarray
    n_kv_head: int
    head_dim_k: int
    head_dim_v: int
    _section: layout.CacheSection | None = field(repr=False)
    _order: np.ndarray | None = field(repr=False)
    _k_rot: int = field(default=0, repr=False)
    _v_rot: int = field(default=0, repr=False)
    _k: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    _v: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    # the native engine reads K (and V, when asked) of a run of layers on demand, in position
    # order: (layers, keys, values) -> (K or None, V or None), each one [n, H, d] per layer
    _read: Callable[[range, bool, bool], tuple[list[np.ndarray] | None, list[np.ndarray] | None]] | None = field(
        default=None, repr=False)
    # the observation window (queries of the newest tokens) when the engine records one
    queries: QueryWindow | None = None
    kq_scale: float = 0.0
    # the native engine scores on the device: (q, q_pos, layer) -> [n_kv_head, n]
    _score: Callable[[np.ndarray, np.ndarray, int], np.ndarray] | None = field(default=None, repr=False)
    # H2O's accumulated attention per (layer, KV head, cell), when the engine tallies it
    tally: np.ndarray | None = None
    # how many tokens each (layer, KV head, cell) stands for (merging methods), float32
    # [n_layer, n_kv_head, n_cells]; None: one each. ``bias``: attention adds log(counts)
    counts: np.ndarray | None = None
    bias: bool = False
    _attn: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, repr=False)
    # the native engine sums the keys' squares on the device: () -> float32 [n_layer, n_kv_head, n]
    _key_sqnorms: Callable[[], np.ndarray] | None = field(default=None, repr=False)
    _sqn: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    # the native engine computes LagKV's scores in the cache's memory: members -> scores or None
    _lag_scores: Callable[[np.ndarray], np.ndarray | None] | None = field(default=None, repr=False)
    scored_layers: list[int] = field(default_factory=list, repr=False)  # in the order they were scored

    @property
    def n_cells(self) -> int:
        return int(self.pos.shape[0])

    @property
    def n_layer(self) -> int:
        return int(self.token_pos.shape[0])

    def log_counts(self, layer: int) -> np.ndarray | None:
        """The bias attention adds to ``layer``'s logits: log(counts) when the engine applies it."""
        return np.log(self.counts[layer]) if self.bias and self.counts is not None else None

    def window_attention(self, layer: int, n_queries: int) -> np.ndarray:
        """float64 [n_kv_head, n_cells]: the attention the newest ``n_queries`` window
        queries pay to each cell, summed over them and over each KV head's query heads
        (``queries.window_attention``; on the device for the native engine). Computed
        once per layer and kept; ``scored_layers`` records which layers paid for it."""
        key = (layer, n_queries)
        if key not in self._attn:
            if self.queries is None:
                raise EdgekvError("this method needs the observation window (queries), which the "
                                  "engine is not recording")
            q, q_pos = self.queries.last(n_queries)
            if self._score is not None:
                a = self._score(q, q_pos, layer)
            else:
                a = window_attention(q[layer], q_pos, self.keys(layer), self.pos, self.kq_scale,
                                     self.log_counts(layer))
            self._attn[key] = np.asarray(a, np.float64)
            self.scored_layers.append(layer)
        return self._attn[key]

    def head_attention(self, layer: int, n_queries: int, heads: list[int]) -> np.ndarray:
        """float64 [len(heads), n_cells]: like ``window_attention`` for single query heads
        (CompressKV's retrieval heads), each summed over the newest ``n_queries`` queries
        only. The native engine scores them on the device, one query head per KV head
        per call."""
        if self.queries is None:
            raise EdgekvError("this method needs the observation window (queries), which the "
                              "engine is not recording")
        q, q_pos = self.queries.last(n_queries)
        n_head = q.shape[1]
        group = n_head // self.n_kv_head
        if any(not 0 <= h < n_head for h in heads):
            raise EdgekvError(f"query heads must be in 0..{n_head - 1}, got {heads}")
        out = np.zeros((len(heads), self.n_cells))
        if self._score is None:
            k = self.keys(layer)
            for i, h in enumerate(heads):
                g = h // group
                out[i] = window_attention(q[layer, h : h + 1], q_pos, k[:, g : g + 1], self.pos, self.kq_scale)[0]
            return out
        # device: rounds of one query head per KV head (rows of unused KV heads are ignored)
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
            a = self._score(qr, q_pos, layer)
            for g, (i, _) in taken.items():
                out[i] = a[g]
            todo = rest
        return out

    @classmethod
    def from_arrays(cls, keys: list[np.ndarray], values: list[np.ndarray],
                    token_pos: np.ndarray | None = None, queries: QueryWindow | None = None,
                    kq_scale: float = 0.0, tally: np.ndarray | None = None,
                    counts: np.ndarray | None = None) -> KVSnapshot:
        """A snapshot of given float K/V ([n, H, d] per layer), for tests,
        benchmarks and the papers' test vectors: methods cannot tell it from
        one read out of llama.cpp."""
        n, h, dk = keys[0].shape
        dv = values[0].shape[2]
        if token_pos is None:
            token_pos = np.broadcast_to(np.arange(n, dtype=np.int32), (len(keys), h, n)).copy()
        return cls(pos=np.arange(n, dtype=np.int32), token_pos=token_pos, n_kv_head=h, head_dim_k=dk,
                   head_dim_v=dv, _section=None, _order=None,
                   _k={i: np.asarray(k, np.float32) for i, k in enumerate(keys)},
                   _v={i: np.asarray(v, np.float32) for i, v in enumerate(values)},
                   queries=queries, kq_scale=kq_scale or 1.0 / np.sqrt(dk), tally=tally,
                   counts=None if counts is None else np.asarray(counts, np.float32))

    def _device_read(self, layer: int, keys: bool, values: bool) -> None:
        """Read ``layer`` and the layers after it, up to ``READ_BYTES``, in one device call:
        scorers read every layer anyway, and one call spreads the layers over the host's
        threads (or one graph) instead of paying a start-up per layer."""
        per_layer = 4 * self.n_cells * self.n_kv_head * (keys * self.head_dim_k + values * self.head_dim_v)
        stop = layer + 1
        while (stop < min(self.n_layer, layer + READ_BYTES // max(per_layer, 1))
               and not (keys and stop in self._k) and not (values and stop in self._v)):
            stop += 1  # up to the first layer already read
        layers = range(layer, stop)
        k, v = self._read(layers, keys, values)
        for i, at in enumerate(layers):
            if k is not None:
                self._k[at] = k[i]
            if v is not None:
                self._v[at] = v[i]

    def keys(self, layer: int) -> np.ndarray:
        """float32 [n_cells, n_kv_head, head_dim_k] (post-RoPE, as cached)."""
        if layer not in self._k and self._read is not None:
            self._device_read(layer, True, False)  # keys only: scorers rarely need values
        if layer not in self._k:
            ld = self._section.layers[layer]
            n_embd = self.n_kv_head * self.head_dim_k
            k = _unrotate(dequantize(ld.k, ld.k_type, n_embd)[self._order], self._k_rot)
            self._k[layer] = k.reshape(self.n_cells, self.n_kv_head, self.head_dim_k)
        return self._k[layer]

    def key_norms(self, layer: int) -> np.ndarray:
        """float32 [n_kv_head, n_cells]: the L2 norm of every cached key.

        Taken over the keys as stored (a rotation preserves the norm), with the sum of
        ``key_sqnorms``, so the native engine's device sums and the state engine's host
        sums are the same floats and both engines rank near-ties alike. Without
        reading K back, the native engine pays a few ms where a read costs tens."""
        if layer not in self._sqn:
            if self._key_sqnorms is not None:
                self._sqn.update(enumerate(self._key_sqnorms()))
            else:
                self._sqn[layer] = key_sqnorms(self._stored_keys(layer)).T
        return np.sqrt(self._sqn[layer])

    def lag_scores(self, members: np.ndarray) -> np.ndarray | None:
        """LagKV's scores, K plus V, of groups of cells, each group against the next one,
        computed where the cache lives without reading K and V out: members int
        [n_layer, n_kv_head, G + 1, W] (ordinals in position order, a group ending at its
        first -1) -> float64 [n_layer, n_kv_head, G, W], padding -inf. None where the engine
        cannot (the state engine, a cache llama.cpp rotates or keeps off the host): the
        method then scores ``keys`` and ``values`` itself, to the same doubles."""
        return None if self._lag_scores is None else self._lag_scores(members)

    def _stored_keys(self, layer: int) -> np.ndarray:
        """float32 [n_cells, n_kv_head, head_dim_k] as the cache holds them (still rotated)."""
        if not self._k_rot or self._section is None:
            return self.keys(layer)
        ld = self._section.layers[layer]
        k = dequantize(ld.k, ld.k_type, self.n_kv_head * self.head_dim_k)[self._order]
        return k.reshape(self.n_cells, self.n_kv_head, self.head_dim_k)

    def values(self, layer: int) -> np.ndarray:
        """float32 [n_cells, n_kv_head, head_dim_v]."""
        if layer not in self._v and self._read is not None:
            self._device_read(layer, layer not in self._k, True)  # K once only
        if layer not in self._v:
            ld = self._section.layers[layer]
            n_embd = self.n_kv_head * self.head_dim_v
            raw = ld.v
            if self._section.v_trans:
                # [n_embd_v, n, el] -> [n, n_embd_v * el]: rows of one cell.
                raw = np.ascontiguousarray(raw.transpose(1, 0, 2)).reshape(self.n_cells, -1)
            v = _unrotate(dequantize(raw, ld.v_type, n_embd)[self._order], self._v_rot)
            self._v[layer] = v.reshape(self.n_cells, self.n_kv_head, self.head_dim_v)
        return self._v[layer]


def key_sqnorms(x: np.ndarray) -> np.ndarray:
    """float32 sums of squares over the last axis, computed as ggml's CPU backend does
    (``sqr`` then ``sum_rows``): float32 squares added in order in float64, rounded
    once to float32."""
    x = np.asarray(x, np.float32)
    acc = np.zeros(x.shape[:-1], np.float64)
    for j in range(x.shape[-1]):  # in channel order; np.sum would add in pairs
        acc += np.square(x[..., j], dtype=np.float32)
    return acc.astype(np.float32)


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix exactly as llama.cpp builds it (float32, H @ H = I)."""
    h = np.array([[1.0 / np.sqrt(np.float32(n))]], dtype=np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _unrotate(x: np.ndarray, block: int) -> np.ndarray:
    """Undo llama.cpp's Walsh-Hadamard rotation of quantised caches (H is its own inverse)."""
    if not block:
        return x
    n, c = x.shape
    return (x.reshape(n, c // block, block) @ hadamard(block)).reshape(n, c)


@dataclass
class CacheState:
    """A saved sequence: llama.cpp's blob plus the engine's token map.

    ``counts`` [n_layer, n_kv_head, n_cells] (position order) says how many
    tokens each merged cell stands for, and ``bias`` whether attention adds
    their log (the native engine's log-count bias); llama.cpp's blob carries
    neither. ``window`` is the observation window when the engine records one,
    ``tally`` the accumulated attention when it tallies (H2O).
    """

    blob: bytes
    token_pos: np.ndarray
    engine: str
    counts: np.ndarray | None = None
    bias: bool = False
    window: QueryWindow | None = None
    tally: np.ndarray | None = None  # float32 [rows, n_kv_head, n_cells], position order
    rot: np.ndarray | None = None  # int32 like token_pos: where each key is rotated, if not at token_pos
    pos_shift: int = 0  # token position - llama.cpp position of the cells decoded after the restore

    @property
    def n_cells(self) -> int:
        return int(self.token_pos.shape[-1])


class KVEngine(Protocol):
    """The verbs every engine implements; ``capabilities`` names the optional ones.

    An engine owns the cell count of its sequence: it decodes through its
    context (``decode``) and counts what it appended, as mlx-lm's caches
    advance their own offset in ``update_and_fetch``.
    """

    name: str
    capabilities: frozenset[str]  # of "merge", "score", "read", "bias", "queries"
    # merge(src, dst, bias=): fold cell src[l, h, i] into dst[l, h, i] (count-weighted means of
    # K and V) and drop the sources; with ``bias`` attention adds log(count) (native engine only)
    window: QueryWindow | None  # the observation window, while ``observe`` keeps one
    tally: AttentionTally | None  # accumulated attention, while ``observe(..., tally=True)`` keeps one

    @property
    def n_cells(self) -> int: ...

    def decode(self, tokens: list[int], start_pos: int, *, all_logits: bool = False) -> None: ...

    def snapshot(self) -> KVSnapshot: ...

    def compact(self, keep: np.ndarray) -> None: ...

    def save(self) -> CacheState: ...

    def restore(self, state: CacheState) -> None: ...

    def reset(self) -> None: ...

    def shift(self, n_keep: int, n_discard: int) -> int: ...

    def renumber(self) -> int: ...

    def observe(self, size: int, *, tally: bool = False) -> None: ...

    def merge(self, src: np.ndarray, dst: np.ndarray, *, bias: bool) -> None: ...


@dataclass
class TokenMap:
    """Which original token each (layer, KV head, cell) holds, and how many cells
    the sequence has: the bookkeeping llama.cpp cannot do for a per-head cache.

    ``token_pos`` covers the cells up to the last compaction (or restore); cells
    decoded since then hold whole tokens at their llama.cpp position plus
    ``pos_shift`` (the positions context shifts and renumbering took away).
    ``rot`` is the position each tracked key is rotated to, once a context shift or
    a renumbering made it differ from ``token_pos`` (None until then); keys decoded
    since are rotated to their llama.cpp position."""

    n_kv_head: int
    token_pos: np.ndarray = field(init=False)
    n_cells: int = 0
    pos_shift: int = 0
    # tokens each tracked cell stands for after merges, float32 like token_pos; None: one each
    counts: np.ndarray | None = field(init=False, default=None)
    rot: np.ndarray | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.token_pos = np.zeros((0, self.n_kv_head, 0), dtype=np.int32)
        self.counts = None
        self.rot = None
        self.n_cells = 0
        self.pos_shift = 0

    def full(self, pos_sorted: np.ndarray, n_layer: int) -> np.ndarray:
        """int32 [n_layer, n_kv_head, n]: the tracked map extended by the cells decoded since."""
        tracked = self.token_pos
        m = tracked.shape[2] if tracked.shape[0] else 0
        n = pos_sorted.shape[0]
        tp = np.empty((n_layer, self.n_kv_head, n), dtype=np.int32)
        if m:
            tp[:, :, :m] = tracked
        tp[:, :, m:] = pos_sorted[m:] + self.pos_shift
        return tp

    def full_rot(self, pos_sorted: np.ndarray, n_layer: int) -> np.ndarray:
        """int32 [n_layer, n_kv_head, n]: the position each key is rotated to (RoPE)."""
        m = self.token_pos.shape[2] if self.token_pos.shape[0] else 0
        out = self.full(pos_sorted, n_layer)
        if self.rot is not None:
            out[:, :, :m] = self.rot
        out[:, :, m:] = pos_sorted[m:]  # llama.cpp rotates a decoded key to its cell's position
        return out

    def full_counts(self, n_layer: int, n: int) -> np.ndarray | None:
        """float32 [n_layer, n_kv_head, n]: the tracked counts, cells decoded since count 1;
        None while nothing was merged."""
        if self.counts is None:
            return None
        out = np.ones((n_layer, self.n_kv_head, n), np.float32)
        out[:, :, : self.counts.shape[2]] = self.counts
        return out

    def set(self, token_pos: np.ndarray, counts: np.ndarray | None = None, rot: np.ndarray | None = None) -> None:
        """After a compaction, merge or restore: exactly these cells, in position order."""
        self.token_pos = np.asarray(token_pos, dtype=np.int32).copy()
        self.n_cells = int(self.token_pos.shape[-1])
        for name, a in (("merge counts", counts), ("key rotations", rot)):
            if a is not None and a.shape != self.token_pos.shape:
                raise EdgekvError(f"{name} shaped {a.shape} do not match the cells {self.token_pos.shape}")
        self.counts = None if counts is None or np.all(counts == 1) else np.asarray(counts, np.float32).copy()
        self.rot = None if rot is None or np.array_equal(rot, token_pos) else np.asarray(rot, np.int32).copy()

    def compacted(self, pos_sorted: np.ndarray, n_layer: int, keep: np.ndarray) -> None:
        """Track a compaction to ``keep`` (checked indices into the position-sorted cells)."""
        counts = self.full_counts(n_layer, pos_sorted.shape[0])
        # while no key was rotated off its token's position, the rotations are the positions
        rotated = self.rot is not None or self.pos_shift != 0
        self.set(np.take_along_axis(self.full(pos_sorted, n_layer), keep, axis=2),
                 None if counts is None else np.take_along_axis(counts, keep, axis=2),
                 np.take_along_axis(self.full_rot(pos_sorted, n_layer), keep, axis=2) if rotated else None)


def check_keep(keep: np.ndarray, n_layer: int, n_kv_head: int, n_cells: int) -> np.ndarray:
    """Validate per-(layer, head) kept indices; return them as int64.

    The contract every method and engine relies on: same count B everywhere,
    strictly increasing (token order is cell order), within the cache, and
    the newest cell kept by every head so that ``pos_max`` is unchanged and
    decoding continues at pos_max + 1.
    """
    keep = np.asarray(keep)
    if keep.ndim != 3 or keep.shape[:2] != (n_layer, n_kv_head):
        raise EdgekvError(
            f"keep indices must be shaped [n_layer={n_layer}, n_kv_head={n_kv_head}, B], got {keep.shape}"
        )
    if not np.issubdtype(keep.dtype, np.integer):
        raise EdgekvError(f"keep indices must be integers, got {keep.dtype}")
    keep = keep.astype(np.int64)
    b = keep.shape[2]
    if b < 1 or b > n_cells:
        raise EdgekvError(f"cannot keep {b} of {n_cells} cells")
    if keep.min() < 0 or keep.max() >= n_cells:
        raise EdgekvError(f"keep indices out of range [0, {n_cells})")
    if b > 1 and not np.all(np.diff(keep, axis=2) > 0):
        raise EdgekvError("keep indices must be strictly increasing per (layer, head)")
    if not np.all(keep[:, :, -1] == n_cells - 1):
        raise EdgekvError("every (layer, head) must keep the newest cell (it carries pos_max)")
    return keep


def compacted_positions(pos: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Cell positions after a compaction: the earliest position each new cell holds.

    Strictly increasing because every head's kept list is; equal to the true
    position wherever all heads keep the same token (the recent window, and
    always the newest cell).
    """
    return pos[keep].reshape(-1, keep.shape[2]).min(axis=0).astype(np.int32)


def check_merge(src: np.ndarray, dst: np.ndarray, n_layer: int, n_kv_head: int,
                n_cells: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate a merge: ``src`` and ``dst`` int [n_layer, n_kv_head, m] (cells in
    position order), the same m everywhere so the heads stay equally long; sources
    distinct per head, never a destination, never the newest cell (it carries pos_max)."""
    src, dst = np.asarray(src), np.asarray(dst)
    if src.ndim != 3 or src.shape[:2] != (n_layer, n_kv_head) or dst.shape != src.shape:
        raise EdgekvError(f"merge sources and destinations must both be [n_layer={n_layer}, "
                          f"n_kv_head={n_kv_head}, m], got {src.shape} and {dst.shape}")
    if not (np.issubdtype(src.dtype, np.integer) and np.issubdtype(dst.dtype, np.integer)):
        raise EdgekvError("merge cells must be integers")
    src, dst = src.astype(np.int64), dst.astype(np.int64)
    m = src.shape[2]
    if m < 1 or m >= n_cells:
        raise EdgekvError(f"cannot merge {m} of {n_cells} cells away")
    if min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= n_cells:
        raise EdgekvError(f"merge cells out of range [0, {n_cells})")
    s = np.sort(src, axis=2)
    if m > 1 and not np.all(np.diff(s, axis=2) > 0):
        raise EdgekvError("a cell can be merged away only once per (layer, head)")
    if np.any(s[:, :, -1] == n_cells - 1):
        raise EdgekvError("the newest cell cannot be merged away (it carries pos_max)")
    for lh in np.ndindex(n_layer, n_kv_head):
        if np.isin(dst[lh], s[lh], assume_unique=False).any():
            raise EdgekvError("a merge destination cannot be a source of the same merge")
    return src, dst


def merge_keep(src: np.ndarray, n_cells: int) -> np.ndarray:
    """int64 [n_layer, n_kv_head, n_cells - m]: the cells a merge keeps, ascending."""
    alive = np.ones(src.shape[:2] + (n_cells,), bool)
    np.put_along_axis(alive, src, False, axis=2)
    return np.nonzero(alive)[2].reshape(src.shape[0], src.shape[1], n_cells - src.shape[2])


def merged_counts(counts: np.ndarray | None, src: np.ndarray, dst: np.ndarray, n_cells: int) -> np.ndarray:
    """float32 [n_layer, n_kv_head, n_cells]: counts after the merge, sources not yet removed."""
    out = (np.ones(src.shape[:2] + (n_cells,), np.float32) if counts is None
           else np.array(counts, np.float32))
    for lh in np.ndindex(*src.shape[:2]):
        np.add.at(out[lh], dst[lh], out[lh][src[lh]])
    return out


def average_rows(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float32 [G, d]: the w-weighted mean of each group's rows ``x`` [G, M, d], computed
    as the native merge op does (weights normalised in float64 and rounded to float32,
    float32 products, a float64 running sum), so both engines write the same bytes."""
    w = np.asarray(w, np.float64)
    wn = (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
    prod = (np.asarray(x, np.float32) * wn[:, :, None]).astype(np.float64)
    return np.cumsum(prod, axis=1)[:, -1].astype(np.float32)


def merge_groups(src: np.ndarray, dst: np.ndarray) -> list[np.ndarray]:
    """One (layer, head)'s merge as groups: int64 [G, M] arrays, each row a destination
    followed by its sources in ascending order, padded with -1. Groups are binned by size
    (M a power of two) so that one large group does not pad every other."""
    order = np.lexsort((src, dst))
    d, s = dst[order], src[order]
    starts = np.flatnonzero(np.r_[True, d[1:] != d[:-1]])
    sizes = np.diff(np.r_[starts, d.size]) + 1  # the destination and its sources
    width = 1 << np.ceil(np.log2(sizes)).astype(int)
    out = []
    for w in np.unique(width):
        idx = np.flatnonzero(width == w)
        g = -np.ones((idx.size, int(w)), np.int64)
        g[:, 0] = d[starts[idx]]
        for row, i in enumerate(idx):
            g[row, 1 : sizes[i]] = s[starts[i] : starts[i] + sizes[i] - 1]
        out.append(g)
    return out
