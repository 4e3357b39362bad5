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

from ..errors import EdgekvError, StateLayoutError
from ..llama import Context, hadamard
from . import layout
from .quant import dequantize, row_size


@dataclass
class KVSnapshot:
    """Dequantised keys/values of one sequence's compressible cache.

    Cells are in position order. ``token_pos[l, h, j]`` is the original
    position of the token whose K/V sit in cell ``j`` of (layer ``l``, head
    ``h``): after a compaction, cell j holds different tokens in different
    heads (shared/DESIGN.md section 2). ``pos`` is llama.cpp's per-cell
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
    # the native engine reads one layer's K and V on demand, already in position order
    _read: Callable[[int], tuple[np.ndarray, np.ndarray]] | None = field(default=None, repr=False)

    @property
    def n_cells(self) -> int:
        return int(self.pos.shape[0])

    @property
    def n_layer(self) -> int:
        return int(self.token_pos.shape[0])

    @classmethod
    def from_arrays(cls, keys: list[np.ndarray], values: list[np.ndarray],
                    token_pos: np.ndarray | None = None) -> KVSnapshot:
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
                   _v={i: np.asarray(v, np.float32) for i, v in enumerate(values)})

    def keys(self, layer: int) -> np.ndarray:
        """float32 [n_cells, n_kv_head, head_dim_k] (post-RoPE, as cached)."""
        if layer not in self._k and self._read is not None:
            self._k[layer], self._v[layer] = self._read(layer)
        if layer not in self._k:
            ld = self._section.layers[layer]
            n_embd = self.n_kv_head * self.head_dim_k
            k = _unrotate(dequantize(ld.k, ld.k_type, n_embd)[self._order], self._k_rot)
            self._k[layer] = k.reshape(self.n_cells, self.n_kv_head, self.head_dim_k)
        return self._k[layer]

    def values(self, layer: int) -> np.ndarray:
        """float32 [n_cells, n_kv_head, head_dim_v]."""
        if layer not in self._v and self._read is not None:
            self._k[layer], self._v[layer] = self._read(layer)
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


def _unrotate(x: np.ndarray, block: int) -> np.ndarray:
    """Undo llama.cpp's Walsh-Hadamard rotation of quantised caches (H is its own inverse)."""
    if not block:
        return x
    n, c = x.shape
    return (x.reshape(n, c // block, block) @ hadamard(block)).reshape(n, c)


@dataclass
class CacheState:
    """A saved sequence: llama.cpp's blob plus the engine's token map.

    ``bias`` is the native engine's log-count bias [n_layer, n_kv_head, n_cells]
    (position order) when merged cells exist; llama.cpp's blob does not carry it.
    """

    blob: bytes
    token_pos: np.ndarray
    engine: str
    bias: np.ndarray | None = None

    @property
    def n_cells(self) -> int:
        return int(self.token_pos.shape[-1])


class KVEngine(Protocol):
    name: str

    @property
    def n_cells(self) -> int: ...

    def snapshot(self) -> KVSnapshot: ...

    def compact(self, keep: np.ndarray) -> None: ...

    def save(self) -> CacheState: ...

    def restore(self, state: CacheState) -> None: ...

    def note_decoded(self, n: int) -> None: ...


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


class StateEngine:
    """KV engine over ``llama_state_seq_get_data`` / ``set_data`` (any stock libllama)."""

    name = "state"

    def __init__(self, ctx: Context, seq: int = 0) -> None:
        arch = ctx.model.arch
        self.ctx = ctx
        self.seq = seq
        self.n_kv_head = arch.n_head_kv
        self.head_dim_k = arch.head_dim_k
        self.head_dim_v = arch.head_dim_v
        # iSWA models (Gemma 3) write the full-attention cache, then the
        # sliding-window one. Only the first is compressed; the SWA cache is
        # already bounded by its window and is written back byte for byte.
        self.n_caches = 2 if arch.n_swa > 0 else 1
        self._token_pos = np.zeros((0, self.n_kv_head, 0), dtype=np.int32)
        self._n_cells = 0
        self._pos_shift = 0  # positions removed by context shifts, to recover original positions

    # -- accounting ------------------------------------------------------------
    @property
    def n_cells(self) -> int:
        return self._n_cells

    def note_decoded(self, n: int) -> None:
        """Tell the engine that n new cells were appended by llama_decode."""
        self._n_cells += n

    def shift(self, n_keep: int, n_discard: int) -> int:
        """llama.cpp's context shift on this sequence: drop cells n_keep..n_keep+n_discard-1
        (token order) and move the later ones down by n_discard positions. Returns
        the position delta. Only valid on a cache whose cells are whole tokens
        (never compacted per head), which the caller guarantees."""
        snap = self.snapshot()
        if not np.all(snap.token_pos == snap.token_pos[:1, :1]):
            raise EdgekvError("context shift needs an uncompacted cache (same tokens in every head)")
        pos = snap.pos
        p0, p1 = int(pos[n_keep]), int(pos[n_keep + n_discard])
        delta = p1 - p0
        if not self.ctx.seq_rm(self.seq, p0, p1):
            raise EdgekvError("llama.cpp refused to remove the shifted range")
        self.ctx.seq_add(self.seq, p1, -1, -delta)
        keep = np.concatenate([np.arange(n_keep), np.arange(n_keep + n_discard, snap.n_cells)])
        self._token_pos = snap.token_pos[:, :, keep]
        self._n_cells = keep.size
        self._pos_shift += delta
        return delta

    def reset(self) -> None:
        self._pos_shift = 0
        self._n_cells = 0
        self._token_pos = np.zeros((0, self.n_kv_head, 0), dtype=np.int32)

    # -- parsing ---------------------------------------------------------------
    def _parse(self) -> layout.SeqState:
        blob = self.ctx.state_get(self.seq)
        st = layout.parse_seq_state(blob, n_caches=self.n_caches, n_layers=None)
        total = sum(len(s.layers) for s in st.sections if s.n_cells) if self.n_caches > 1 else len(
            st.sections[0].layers
        )
        if st.sections[0].n_cells and self.n_caches == 1 and total != self.ctx.model.arch.n_layer:
            raise StateLayoutError(
                f"state holds {total} layers, model has {self.ctx.model.arch.n_layer}"
            )
        sec = st.sections[0]
        for il, ld in enumerate(sec.layers):
            want = row_size(ld.k_type, self.n_kv_head * self.head_dim_k)
            if ld.k_row_bytes != want:
                raise StateLayoutError(
                    f"layer {il}: K row is {ld.k_row_bytes} bytes, expected {want} "
                    f"({self.n_kv_head} heads x {self.head_dim_k})"
                )
            if sec.v_trans:
                if ld.n_embd_v != self.n_kv_head * self.head_dim_v:
                    raise StateLayoutError(f"layer {il}: V has {ld.n_embd_v} channels")
            elif ld.v_row_bytes != row_size(ld.v_type, self.n_kv_head * self.head_dim_v):
                raise StateLayoutError(f"layer {il}: V row is {ld.v_row_bytes} bytes")
        if sec.n_cells != self._n_cells:
            raise StateLayoutError(
                f"llama.cpp holds {sec.n_cells} cells for the sequence, the engine counted {self._n_cells}"
            )
        return st

    def _token_map(self, pos_sorted: np.ndarray, n_layer: int) -> np.ndarray:
        """Extend the tracked token map with cells decoded since the last compaction."""
        tracked = self._token_pos
        m = tracked.shape[2] if tracked.shape[0] else 0
        n = pos_sorted.shape[0]
        tp = np.empty((n_layer, self.n_kv_head, n), dtype=np.int32)
        if m:
            tp[:, :, :m] = tracked
        tp[:, :, m:] = pos_sorted[m:] + self._pos_shift
        return tp

    def snapshot(self) -> KVSnapshot:
        st = self._parse()
        sec = st.sections[0]
        order = np.argsort(sec.pos, kind="stable")
        pos = sec.pos[order]
        return KVSnapshot(
            pos=pos,
            token_pos=self._token_map(pos, len(sec.layers)),
            n_kv_head=self.n_kv_head,
            head_dim_k=self.head_dim_k,
            head_dim_v=self.head_dim_v,
            _section=sec,
            _order=order,
            _k_rot=self.ctx.k_rot,
            _v_rot=self.ctx.v_rot,
        )

    # -- verbs -----------------------------------------------------------------
    def compact(self, keep: np.ndarray) -> None:
        st = self._parse()
        sec = st.sections[0]
        order = np.argsort(sec.pos, kind="stable")
        pos = sec.pos[order]
        keep = check_keep(keep, len(sec.layers), self.n_kv_head, sec.n_cells)
        new_pos = compacted_positions(pos, keep)
        token_pos = self._token_map(pos, len(sec.layers))
        new_tp = np.take_along_axis(token_pos, keep, axis=2)
        st.sections[0] = layout.gather_section(sec, order, keep, new_pos, self.n_kv_head)
        self.ctx.state_set(layout.write_seq_state(st), self.seq)
        self._token_pos = new_tp.astype(np.int32)
        self._n_cells = keep.shape[2]

    def save(self) -> CacheState:
        blob = self.ctx.state_get(self.seq)
        st = layout.parse_seq_state(blob, n_caches=self.n_caches, n_layers=None)
        sec = st.sections[0]
        pos = np.sort(sec.pos)
        n_layer = len(sec.layers)
        return CacheState(blob=blob, token_pos=self._token_map(pos, n_layer), engine=self.name)

    def restore(self, state: CacheState) -> None:
        # Validate before handing llama.cpp anything: it would replace the
        # sequence first and only then notice a mismatch.
        st = layout.parse_seq_state(state.blob, n_caches=self.n_caches, n_layers=None)
        if st.sections[0].n_cells != state.n_cells:
            raise StateLayoutError("saved state and its token map disagree on the cell count")
        if state.n_cells > self.ctx.n_ctx:
            raise StateLayoutError(
                f"saved state holds {state.n_cells} cells, this context has {self.ctx.n_ctx}"
            )
        self.ctx.state_set(state.blob, self.seq)
        self._token_pos = state.token_pos.copy()
        self._n_cells = state.n_cells
