"""The native engine: edgekv's ggml ops inside the patched libllama (ggml_patches/).

Same verbs as the state engine, done where the cache lives: ``compact`` gathers
each (layer, KV head)'s kept rows into cells 0..B-1 with a ggml graph on the
cache's backend instead of copying the sequence to the host and back. On top of
the protocol it offers the ops the state API cannot: ``merge`` (weighted average
of cells, with a per (layer, head, cell) log-count bias that attention adds to
the logits), ``read`` (dequantised K/V of a run of layers) and ``score``
(observation-window attention computed on the device).

The bindings are a cffi module (``edgekv._edgekv_native``) that
``native/build_native.py`` compiles against the installed ``llama-edgekv.h``;
without it, or on a cache the ops do not handle (iSWA, several sequences),
``make_engine("auto")`` picks the state engine.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from ..errors import EdgekvError, StateLayoutError
from ..llama import Context
from .cells import (
    check_keep,
    check_merge,
    compacted_positions,
    merge_groups,
    merge_keep,
    merged_counts,
)
from .engine import CacheState
from .queries import AttentionTally, QueryMoments, QueryWindow
from .snapshot import KVSnapshot, unrotate
from .state import StateEngine

_ERRORS = {
    -1: "the KV cache is of a kind the native ops do not handle (iSWA, several sequences or streams, "
        "a pending shift, uneven heads)",
    -2: "an argument is out of range",
    -3: "the ggml graph could not be allocated or computed",
    -4: "the cache type's rows cannot be moved or converted by the native ops",
    -5: "no backend of the context can run an op that writes into the cache (ggml_backend_supports_op said "
        "no; llama.cpp's log names the op and type); a compaction falls back to the state engine, a merge with "
        "the log-count bias cannot",
}


NATIVE_API = 11  # the patch set version (LLAMA_EDGEKV_API_VERSION) these bindings are written for
READ_BYTES = 32 << 20  # float32 K+V one native read brings back at most (its device output buffer)


class ReadBuffers:
    """float32 buffers for device reads, handed out again once nobody holds them.

    On small machines, fresh pages cost more than the read itself: the first touch of
    each page faults, and a snapshot of a 1k-cell cache reads tens of MB per
    compression. A buffer is reused only when no array refers to it any more (its
    reference count), so an array handed out never changes under its holder. At most
    ``cap`` bytes are kept between reads."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        # what an idle buffer's reference count reads as, taken exactly the way take() reads
        # it (the pool's list, the loop variable, the call; it differs between Python
        # versions): keep the comprehensions here and in take() alike
        self._pool: list[np.ndarray] = [np.empty(1, np.float32)]
        self._idle_refs = [self._refs(b) for b in self._pool][0]
        self._pool = []

    @staticmethod
    def _refs(b: np.ndarray) -> int:
        return sys.getrefcount(b)

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        free = [b for b in self._pool if b.size >= n and self._refs(b) <= self._idle_refs]
        if free:
            return min(free, key=lambda b: b.size)[:n].reshape(shape)
        buf = np.empty(n + n // 8, np.float32)  # headroom: the cache grows between reads
        if buf.nbytes > self.cap:
            return buf[:n].reshape(shape)  # too big to keep: the pool stays as it is
        kept = sum(b.nbytes for b in self._pool)
        while self._pool and kept + buf.nbytes > self.cap:  # make room: drop unused buffers first
            idle = [b for b in self._pool if self._refs(b) <= self._idle_refs]
            drop = min(idle, key=lambda b: b.size) if idle else self._pool[0]
            self._pool = [b for b in self._pool if b is not drop]
            kept -= drop.nbytes
        if kept + buf.nbytes <= self.cap:
            self._pool.append(buf)
        return buf[:n].reshape(shape)


class NativeUnsupported(EdgekvError):
    """The native ops cannot serve this context; the state engine can."""


def load() -> tuple[Any, Any] | None:
    """(ffi, lib) of the compiled bindings, or None when they are not built or do not load."""
    try:
        from .. import _edgekv_native as mod  # type: ignore[attr-defined]
    except ImportError:
        return None
    try:
        if mod.lib.llama_edgekv_api_version() < NATIVE_API:
            return None
    except AttributeError:
        return None
    return mod.ffi, mod.lib


def api_version() -> int:
    m = load()
    return int(m[1].llama_edgekv_api_version()) if m else 0


def _alibi_slopes(info: Any, n_kv_head: int) -> np.ndarray | None:
    """ALiBi's slope per KV head (ggml's soft_max, per query head), or None without ALiBi.
    A per-KV-head bias can only carry one slope per KV head, so grouped-query ALiBi is
    left to the state engine, which refuses per-head compactions."""
    if not info.max_alibi_bias:
        return None
    if info.n_head != n_kv_head:
        raise NativeUnsupported("native engine: ALiBi with grouped-query attention (one bias per KV head "
                                "cannot carry the slopes of several query heads)")
    n_log2 = 1 << int(np.floor(np.log2(info.n_head)))
    m0 = 2.0 ** (-info.max_alibi_bias / n_log2)
    m1 = 2.0 ** (-(info.max_alibi_bias / 2.0) / n_log2)
    return np.array([m0 ** (h + 1) if h < n_log2 else m1 ** (2 * (h - n_log2) + 1) for h in range(info.n_head)])


def _ptr(ctx: Context) -> int:
    p = ctx.ptr
    return p if isinstance(p, int) else ctypes.cast(p, ctypes.c_void_p).value


class NativeEngine:
    """KV engine over edgekv's native ops.

    A sibling of the state engine that holds one: llama.cpp's state API still
    saves and restores the sequence (the blob is the same either way), applies
    context shifts, and serves while a shift's K-shift is pending, which the
    native ops refuse. Both share one token map.
    """

    name = "native"

    def __init__(self, ctx: Context, seq: int = 0) -> None:
        m = load()
        if m is None:
            raise NativeUnsupported("edgekv's native bindings are not built (native/build_native.py) "
                                    "or libllama lacks edgekv's patches")
        self.ffi, self.lib = m
        self.ctx = ctx
        self.seq = seq
        self._portable = StateEngine(ctx, seq)
        self._portable.attention = self._device_attention  # H2O's tally where it is scored: on the device
        self.capabilities = frozenset({"merge", "score", "read", "bias"}) | self._portable.capabilities
        self.tokens = self._portable.tokens
        self.n_kv_head = self._portable.n_kv_head
        self.head_dim_k = self._portable.head_dim_k
        self.head_dim_v = self._portable.head_dim_v
        if self._portable.n_caches != 1:
            raise NativeUnsupported("native engine: iSWA caches (two caches per sequence) use the state engine")
        out = self.ffi.new("int32_t[5]")
        rc = self.lib.llama_edgekv_cache_info(self._c, out, out + 1, out + 2, out + 3, out + 4)
        if rc != 0:
            raise NativeUnsupported(f"native engine: {_ERRORS.get(rc, rc)}")
        self.n_layer, n_head_kv, hk, hv, self.kv_size = (int(x) for x in out)
        self._gen = 0  # bumped whenever the cache changes; a snapshot reads lazily and must not outlive it
        self._biased = False  # attention adds log(counts): merged cells weigh what they stand for
        self._alibi = _alibi_slopes(ctx.model.info, self.n_kv_head)  # None: the model has no ALiBi
        # two reads' buffers, each with take()'s headroom: one being scored, one read ahead.
        # Without the headroom in the cap only one full read fit (8k cells, five layers of
        # K: 35 MB), and three to five of a ProtoKV compression's six reads took fresh pages
        self._buffers = ReadBuffers(2 * (READ_BYTES + READ_BYTES // 8))
        if (n_head_kv, hk, hv) != (self.n_kv_head, self.head_dim_k, self.head_dim_v):
            raise NativeUnsupported("native engine: the cache's geometry differs from the model's")

    @property
    def n_cells(self) -> int:
        return self.tokens.n_cells

    @property
    def generation(self) -> int:
        """Bumped whenever the cache changes: a snapshot reads lazily and must not outlive it."""
        return self._gen

    # -- helpers ---------------------------------------------------------------
    @property
    def _c(self) -> Any:
        """The live llama_context; a closed one is refused (a snapshot may outlive its session)."""
        if not self.ctx.ptr:
            raise EdgekvError("the llama.cpp context is closed; the native engine cannot read it")
        return self.ffi.cast("struct llama_context *", _ptr(self.ctx))

    def _check(self, rc: int, what: str) -> None:
        if rc in (-1, -5):  # a cache the ops cannot handle, or a backend that cannot write it: the state engine can
            raise NativeUnsupported(f"native {what}: {_ERRORS[rc]}")
        if rc < 0:
            raise EdgekvError(f"native {what}: {_ERRORS.get(rc, f'error {rc}')}")

    def _i32(self, a: np.ndarray) -> Any:
        return self.ffi.from_buffer("int32_t[]", a)

    def _f32(self, a: np.ndarray) -> Any:
        return self.ffi.from_buffer("float[]", a)

    def cell_positions(self) -> np.ndarray:
        """Positions of the sequence's cells in cell order (the ordinals the C ops take)."""
        n = self.lib.llama_edgekv_seq_cells(self._c, self.seq, self.ffi.NULL, 0)
        self._check(n, "cells")
        pos = np.empty(n, dtype=np.int32)
        if n:
            self._check(self.lib.llama_edgekv_seq_cells(self._c, self.seq, self._i32(pos), n), "cells")
        if n != self.n_cells:
            raise StateLayoutError(f"llama.cpp holds {n} cells for the sequence, the engine counted {self.n_cells}")
        return pos

    # -- verbs -----------------------------------------------------------------
    # llama.cpp's context shift (seq_add) leaves a K-shift pending until the next
    # decode; the native ops refuse such a cache. ``shift`` applies it at once
    # (``llama_edgekv_shift_apply``); a shift made some other way leaves the state
    # API (which does not care) to serve until a decode applies it.
    def snapshot(self) -> KVSnapshot:
        try:
            return self._snapshot()
        except NativeUnsupported:
            return self._portable.snapshot()

    def compact(self, keep: np.ndarray) -> None:
        self._gen += 1
        try:
            self._compact(keep)
        except NativeUnsupported:
            self._portable.compact(keep)

    def decode(self, tokens: list[int], start_pos: int, *, all_logits: bool = False) -> None:
        self._gen += 1
        self._portable.decode(tokens, start_pos, all_logits=all_logits)

    def reset(self) -> None:
        self._gen += 1
        self._biased = False
        self._portable.reset()

    def shift(self, n_keep: int, n_discard: int) -> int:
        self._gen += 1
        try:  # the positions from the cells op, not from a parse of the whole state blob
            cell_pos = self.cell_positions()
        except NativeUnsupported:  # a shift still pending: the state API serves
            cell_pos = None
        delta = self._portable.shift(n_keep, n_discard, cell_pos)
        # the re-rotation now, not in the next turn's first decode (0.2 s at 4k cells, f16):
        # a compression made ahead of a turn (Session.make_room) then leaves the turn nothing.
        # Should llama.cpp's update fail, the shift stays pending and the next decode applies
        # it, as on the state engine: the shift itself is done and nothing is lost.
        if self.lib.llama_edgekv_shift_apply(self._c) >= 0:
            self._portable.shift_applied()
        return delta

    def renumber(self) -> int:
        """Through the state API (a host round trip); the log-count bias, which a restore
        zeroes, is put back on the same cells."""
        self._gen += 1
        bias = self.bias_get(cell_order=True) if self._biased else None
        delta = self._portable.renumber()
        if bias is not None:
            self.bias_set(bias, cell_order=True)
        return delta

    def observe(self, size: int, *, tally: bool = False, moments: bool = False) -> None:
        self._portable.observe(size, tally=tally, moments=moments)

    @property
    def window(self) -> QueryWindow | None:
        return self._portable.window

    @property
    def tally(self) -> AttentionTally | None:
        return self._portable.tally

    @property
    def moments(self) -> QueryMoments | None:
        return self._portable.moments

    def _device_attention(self, q: np.ndarray, q_pos: np.ndarray) -> np.ndarray:
        try:
            return self.score(q, q_pos, self.ctx.model.info.kq_scale)
        except NativeUnsupported:  # e.g. a pending context shift: the state engine serves
            return self._portable.host_attention(q, q_pos)

    def _snapshot(self) -> KVSnapshot:
        pos_cells = self.cell_positions()
        self._portable.fold_tally(pos_cells)
        order = np.argsort(pos_cells, kind="stable")
        pos = pos_cells[order]
        n = pos.shape[0]
        return NativeSnapshot(
            pos=pos, token_pos=self.tokens.full(pos, self.n_layer), n_kv_head=self.n_kv_head,
            head_dim_k=self.head_dim_k, head_dim_v=self.head_dim_v,
            queries=self.window.copy() if self.window is not None else None,
            kq_scale=self.ctx.model.info.kq_scale,
            tally=self.tally.scores.copy() if self.tally is not None and self.tally.complete else None,
            moments=self.moments.copy() if self.moments is not None else None,
            counts=self.tokens.full_counts(self.n_layer, n), bias=self._biased,
            engine=self, gen=self._gen, order=order, in_order=bool(np.all(order == np.arange(n))))

    def _compact(self, keep: np.ndarray) -> None:
        pos_cells = self.cell_positions()
        self._portable.fold_tally(pos_cells)
        order = np.argsort(pos_cells, kind="stable")
        pos = pos_cells[order]
        keep = check_keep(keep, self.n_layer, self.n_kv_head, pos.shape[0])
        new_pos = np.ascontiguousarray(compacted_positions(pos, keep), dtype=np.int32)
        cells = np.ascontiguousarray(order[keep], dtype=np.int32)
        b = keep.shape[2]
        self._check(self.lib.llama_edgekv_seq_compact(self._c, self.seq, b, self._i32(cells), self._i32(new_pos)),
                    "compact")
        self._portable.compacted(pos, keep)
        if self._alibi is not None:
            self._apply_bias()

    def merge(self, src: np.ndarray, dst: np.ndarray, *, bias: bool) -> None:
        """Fold each source cell into its destination per (layer, KV head) and drop the
        sources. With ``bias`` the count-weighted means are computed on the device
        (``llama_edgekv_seq_merge``, re-quantised by ``ggml_set_rows``) and attention adds
        log(count) from now on; without, attention weighs every cell as one token. An
        unbiased merge takes the device op too, rounding with ggml's reference quantisers,
        and zeroes the bias after it: it writes the state engine's bytes without rewriting
        the whole sequence. Where the op cannot round that way (a quantised cache outside
        host memory) the state engine's merge runs instead. The device merge runs one
        call per group width: if a later call fails, the cache holds some averaged
        destinations without their counts, and the error says the op failed."""
        self._gen += 1
        if not bias and not self._unbiased_on_device():
            self._portable_merge(src, dst)
            return
        pos_cells = self.cell_positions()
        self._portable.fold_tally(pos_cells)
        pos = np.sort(pos_cells)
        n = pos.shape[0]
        src, dst = check_merge(src, dst, self.n_layer, self.n_kv_head, n)
        old = self.tokens.full_counts(self.n_layer, n)
        old = np.ones((self.n_layer, self.n_kv_head, n), np.float32) if old is None else old
        try:
            self._merge_in_place(src, dst, old, reference=not bias)
        except NativeUnsupported:
            if bias:
                raise
            # the op refuses before it changes anything, and its first call is the one that refuses
            self._portable_merge(src, dst)
            return
        self.tokens.set(self.tokens.full(pos, self.n_layer), merged_counts(old, src, dst, n),
                        rot=self.tokens.full_rot(pos, self.n_layer))
        self.compact(merge_keep(src, n))  # a backend that cannot compact: the state engine does it
        if not bias:  # the op wrote log(count); attention weighs every cell as one again
            self._biased = False
            self.bias_set(np.zeros((self.n_layer, self.n_kv_head, self.n_cells), np.float32))
            return
        # the op kept log(count) in float32; the host counts are exact, so the device copies them
        self._biased = True
        self._apply_bias()

    def _unbiased_on_device(self) -> bool:
        """Whether an unbiased merge may run as the device op (see ``merge``)."""
        return self._alibi is None and "bias" in self.capabilities and not self.ctx.model.arch.n_swa

    def _portable_merge(self, src: np.ndarray, dst: np.ndarray) -> None:
        self._portable.merge(src, dst, bias=False)
        self._biased = False  # a state write zeroes the device bias of every cell it writes

    def _merge_in_place(self, src: np.ndarray, dst: np.ndarray, counts: np.ndarray, *, reference: bool) -> None:
        """Run the device merge, one call per group width (``merge_groups``); (layer, head)s
        with fewer groups of a width are padded with groups of one source cell, which
        rewrite that cell unchanged before the compaction drops it."""
        L, H = self.n_layer, self.n_kv_head
        for members in merge_groups(src, dst):
            weights = np.where(members >= 0, np.take_along_axis(
                counts, np.maximum(members, 0).reshape(L, H, -1), axis=2).reshape(members.shape), 0.0)
            self._merge_groups(members, weights.astype(np.float32), reference=reference)

    def save(self) -> CacheState:
        state = self._portable.save()
        state.bias = self._biased and state.counts is not None
        return state

    def restore(self, state: CacheState) -> None:
        self._gen += 1
        self._portable.restore(replace(state, bias=False))
        # llama.cpp zeroes the bias of every cell a restore writes (apply_ubatch, patch 0003)
        self._biased = state.bias and state.counts is not None
        if self._biased or self._alibi is not None:
            self._apply_bias()

    def _apply_bias(self) -> None:
        """Write the per (layer, KV head, cell) bias attention adds to its logits: log(count)
        of merged cells, and on ALiBi models the distance a per-head compaction took from
        each head's tokens. ALiBi biases a key by slope x (its cell's position - the query's);
        a cell that holds, in head h, a token of position t > the cell's position c needs
        slope x (t - c) more, a constant per cell. llama.cpp adds this bias to the mask, which
        ggml's soft_max multiplies by each head's slope under ALiBi, so it is written in
        positions (and log(count) divided by the slope)."""
        counts = self.tokens.full_counts(self.n_layer, self.n_cells) if self._biased else None
        if self._alibi is None:
            if counts is not None:
                self.bias_set(np.log(counts))
            return
        pos = np.sort(self.cell_positions())
        tp = self.tokens.full(pos, self.n_layer).astype(np.float64) - self.tokens.pos_shift
        bias = tp - pos[None, None, :]
        if counts is not None:
            bias += np.log(counts) / self._alibi[None, :, None]
        if not self.bias_enabled:
            self.bias_enable()
        self.bias_set(bias.astype(np.float32))

    # -- native-only ops -------------------------------------------------------
    def _to_cells(self, a: np.ndarray) -> np.ndarray:
        """Reorder the last axis from position order to cell order."""
        out = np.empty_like(a)
        out[..., np.argsort(self.cell_positions(), kind="stable")] = a
        return out

    def read(self, layers: range, cell_order: bool = False, *, keys: bool = True,
             values: bool = True, unrotated: bool = False) -> tuple[np.ndarray | None, np.ndarray | None]:
        """K (None unless ``keys``) and V (None unless ``values``) of a run of layers, in one
        device call: float32 [len(layers), n_kv_head, n_cells, head_dim], cells in position
        order unless ``cell_order``. As stored (rotated where llama.cpp rotates them) unless
        ``unrotated``: then as the model computed them, unrotated by the op over the context's
        threads with ``snapshot.unrotate``'s recipe (the same floats)."""
        n, m = self.n_cells, len(layers)
        if m and layers.step != 1:
            raise EdgekvError(f"read takes a run of consecutive layers, got {layers}")
        k = self._buffers.take((m, self.n_kv_head, n, self.head_dim_k)) if keys else None
        v = self._buffers.take((m, self.n_kv_head, n, self.head_dim_v)) if values else None
        if n and m and (keys or values):
            self._check(self.lib.llama_edgekv_seq_read(self._c, self.seq, layers.start, m,
                                                      self._f32(k) if keys else self.ffi.NULL,
                                                      self._f32(v) if values else self.ffi.NULL, n, unrotated),
                        "read")
        if not cell_order and n:
            order = np.argsort(self.cell_positions(), kind="stable")
            k = None if k is None else k[..., order, :]
            v = None if v is None else v[..., order, :]
        return k, v

    def key_sqnorms(self, cell_order: bool = False) -> np.ndarray:
        """float32 [n_layer, n_kv_head, n_cells]: every stored key's sum of squares, summed
        on the device in one graph for all layers (``KVSnapshot.key_norms``); cells in
        position order unless ``cell_order``."""
        n = self.n_cells
        out = np.zeros((self.n_layer, self.n_kv_head, n), np.float32)
        if n:
            self._check(self.lib.llama_edgekv_seq_key_sqnorms(self._c, self.seq, self._f32(out), n), "key_sqnorms")
            if not cell_order:
                out = out[..., np.argsort(self.cell_positions(), kind="stable")]
        return out

    def value_norms(self, cell_order: bool = False) -> np.ndarray:
        """float64 [n_layer, n_kv_head, n_cells]: every value's L2 norm, computed in the cache's
        host memory without reading V out (``llama_edgekv_seq_value_norms``: numpy's floats
        for the values ``read`` hands out; NativeUnsupported for a cache elsewhere); cells in
        position order unless ``cell_order``."""
        n = self.n_cells
        out = np.zeros((self.n_layer, self.n_kv_head, n))
        if n:
            self._check(self.lib.llama_edgekv_seq_value_norms(self._c, self.seq, self.ffi.from_buffer("double[]", out),
                                                              n), "value_norms")
            if not cell_order:
                out = out[..., np.argsort(self.cell_positions(), kind="stable")]
        return out

    def lag_scores(self, members: np.ndarray) -> np.ndarray:
        """LagKV's scores, K plus V, of groups of cells, each against the next group, computed
        in the cache's host memory (``llama_edgekv_seq_lag_scores``; NativeUnsupported for a
        cache elsewhere). members int [n_layer, n_kv_head, G + 1, W], cell ordinals in cell
        order, a group ending at its first -1 -> float64 [n_layer, n_kv_head, G, W], padding -inf."""
        L, H, g1, w = members.shape
        if (L, H) != (self.n_layer, self.n_kv_head) or g1 < 2 or w < 1:
            raise EdgekvError(f"lag_scores: members must be [{self.n_layer}, {self.n_kv_head}, G + 1 >= 2, W >= 1], "
                              f"got {list(members.shape)}")
        m = np.ascontiguousarray(members, dtype=np.int32)
        out = np.empty((L, H, g1 - 1, w))
        self._check(self.lib.llama_edgekv_seq_lag_scores(self._c, self.seq, g1 - 1, w, self._i32(m),
                                                         self.ffi.from_buffer("double[]", out), self.n_cells),
                    "lag_scores")
        return out

    @property
    def bias_enabled(self) -> bool:
        return bool(self.lib.llama_edgekv_bias_enabled(self._c))

    def bias_enable(self) -> None:
        self._check(self.lib.llama_edgekv_bias_enable(self._c), "bias_enable")

    def bias_get(self, cell_order: bool = False) -> np.ndarray:
        """float32 [n_layer, n_kv_head, n_cells] log-count bias, position order unless ``cell_order``."""
        n = self.n_cells
        b = np.zeros((self.n_layer, self.n_kv_head, n), np.float32)
        if n:
            self._check(self.lib.llama_edgekv_seq_bias_get(self._c, self.seq, self._f32(b), n), "bias_get")
            if not cell_order:
                b = b[..., np.argsort(self.cell_positions(), kind="stable")]
        return b

    def bias_set(self, bias: np.ndarray, cell_order: bool = False) -> None:
        bias = np.asarray(bias, np.float32)
        if bias.shape != (self.n_layer, self.n_kv_head, self.n_cells):
            raise EdgekvError(f"bias must be [n_layer, n_kv_head, n_cells], got {bias.shape}")
        bias = np.ascontiguousarray(bias if cell_order else self._to_cells(bias))
        self._check(self.lib.llama_edgekv_seq_bias_set(self._c, self.seq, self._f32(bias), self.n_cells), "bias_set")

    def _merge_groups(self, members: np.ndarray, weights: np.ndarray, *, reference: bool = False) -> None:
        """The raw device op: average groups of cells per (layer, head) into each group's
        first member (``merge`` drives it and keeps the counts).

        ``members`` int [n_layer, n_kv_head, n_group, n_member] (cells in position
        order, -1 = unused) and ``weights`` float of the same shape. The merged cell's
        log-count bias becomes log(sum of its members' counts); compact the other
        members away afterwards. ``reference`` rounds quantised rows as ggml's reference
        quantisers do (the state engine's bytes) instead of as the backend's set_rows.
        """
        members = np.asarray(members)
        weights = np.asarray(weights, np.float32)
        if members.ndim != 4 or members.shape[:2] != (self.n_layer, self.n_kv_head) or weights.shape != members.shape:
            raise EdgekvError("merge: members and weights must be [n_layer, n_kv_head, n_group, n_member]")
        if np.any(members >= self.n_cells) or np.any(members < -1) or np.any(members[..., 0] < 0):
            raise EdgekvError("merge: member index out of range")
        order = np.argsort(self.cell_positions(), kind="stable")
        cells = np.where(members >= 0, order[np.maximum(members, 0)], -1).astype(np.int32)
        g, m = members.shape[2:]
        self._check(self.lib.llama_edgekv_seq_merge(self._c, self.seq, g, m, self._i32(np.ascontiguousarray(cells)),
                                                   self._f32(np.ascontiguousarray(weights)), reference), "merge")

    def rotate_queries(self, q: np.ndarray) -> np.ndarray:
        """float32 ``q`` [..., head_dim_k] rotated like the cache's keys when llama.cpp
        Hadamard-rotates them (a quantised K), so that q.k is the model's logit; else ``q``.
        H is its own inverse, so this is ``unrotate``: one recipe for every rotation."""
        return unrotate(np.asarray(q, np.float32), self.ctx.k_rot)

    def score(self, q: np.ndarray, q_pos: np.ndarray, kq_scale: float | None = None,
              layers: list[int] | None = None, *, rotated: bool = False) -> np.ndarray:
        """Observation-window attention on the device.

        ``q`` float [n_layer, n_head, n_q, head_dim_k]: post-RoPE queries as the model
        computes them (rotated here like the cache when llama.cpp rotates it, unless
        ``rotated``: ``rotate_queries`` did it once for many calls);
        ``q_pos`` their positions. Returns float32 [n_layer, n_kv_head, n_cells] in
        position order: per KV head, the sum over window queries and the group's query
        heads of softmax(kq_scale * q.k + bias), causal by position. Only ``layers``
        (default: all) are scored; the rows of the others are NaN.
        """
        q = np.asarray(q, np.float32)
        n_layer, n_head, n_q, d = q.shape
        if n_layer != self.n_layer or d != self.head_dim_k or n_head % self.n_kv_head:
            raise EdgekvError(f"score: q must be [{self.n_layer}, k*{self.n_kv_head}, n_q, {self.head_dim_k}]")
        if not rotated:
            q = self.rotate_queries(q)
        q = np.ascontiguousarray(q)
        q_pos = np.ascontiguousarray(q_pos, dtype=np.int32)
        if q_pos.shape != (n_q,):
            raise EdgekvError("score: q_pos must hold one position per query")
        scale = float(kq_scale if kq_scale is not None else 1.0 / np.sqrt(d))
        n = self.n_cells
        out = np.full((self.n_layer, self.n_kv_head, n), np.nan, np.float32)
        todo = np.arange(self.n_layer, dtype=np.int32) if layers is None else np.asarray(layers, np.int32)
        if todo.size and (todo.min() < 0 or todo.max() >= self.n_layer):
            raise EdgekvError(f"score: layers must be in 0..{self.n_layer - 1}")
        todo = np.ascontiguousarray(todo)
        self._check(self.lib.llama_edgekv_seq_score(self._c, self.seq, n_head, n_q, self._f32(q), self._i32(q_pos),
                                                   scale, self._i32(todo), int(todo.size), self._f32(out), n),
                    "score")
        pos = self.cell_positions()
        if np.all(pos[1:] > pos[:-1]):  # cells already in position order (the usual case): no copy
            return out
        return out[..., np.argsort(pos, kind="stable")]


@dataclass
class NativeSnapshot(KVSnapshot):
    """The native engine's snapshot: layers read on demand through the device ops, key
    norms, window attention and LagKV's scores computed where the cache lives. Valid
    until the cache changes (``engine``'s generation moves on)."""

    accelerators: ClassVar[frozenset[str]] = frozenset({"key_norms", "window_attention", "lag_scores", "value_norms"})

    engine: NativeEngine = field(kw_only=True, repr=False)
    gen: int = field(kw_only=True, repr=False)  # the engine's generation when taken
    order: np.ndarray = field(kw_only=True, repr=False)  # cell ordinals in position order
    in_order: bool = field(kw_only=True, repr=False)  # cells already in position order (the usual case)
    _rotated: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)  # (window queries, rotated)
    # layers read (unrotated by the read op) but not yet put in position order ([H, n, d] as
    # read): the thread that asks for a layer gathers it, outside the lock, so scoring
    # threads share the gathers of a cache whose cells are out of order
    _read_k: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    _read_v: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    # every layer's value norms [n_layer, n_kv_head, n] in position order, from one call;
    # an empty array where the op cannot run
    _vnorms: np.ndarray | None = field(default=None, repr=False)

    def _live(self) -> NativeEngine:
        if self.engine.generation != self.gen:
            raise EdgekvError("the cache changed since this snapshot was taken; take a new one")
        return self.engine

    def _cells_major(self, x: np.ndarray) -> np.ndarray:
        """[H, n, d] in cell order -> [n, H, d] in position order (a view where it can)."""
        return (x if self.in_order else x[:, self.order]).transpose(1, 0, 2)

    def release(self, layer: int) -> None:
        with self._lock:
            for d in (self._k, self._v, self._read_k, self._read_v):
                d.pop(layer, None)  # read again if asked, while the cache is unchanged

    def prefetch(self, layer: int, values: bool = False) -> None:
        with self._lock:
            want_k = layer not in self._k and layer not in self._read_k
            want_v = values and layer not in self._v and layer not in self._read_v
            if want_k or want_v:
                self._load(layer, want_k, want_v)

    def keys(self, layer: int) -> np.ndarray:
        return self._converted(layer, True)

    def values(self, layer: int) -> np.ndarray:
        return self._converted(layer, False)

    def _converted(self, layer: int, keys: bool) -> np.ndarray:
        """``layer``'s K or V in position order, unrotated: read under the lock if it was not
        (with K when asking V and K is not there either: one device call), ordered here."""
        done, read = (self._k, self._read_k) if keys else (self._v, self._read_v)
        with self._lock:
            if layer in done:
                return done[layer]
            if layer not in read:
                self.prefetch(layer, values=not keys)
            x = read[layer]
        x = self._cells_major(x)
        with self._lock:
            read.pop(layer, None)
            return done.setdefault(layer, x)  # another thread may have converted it meanwhile

    def _load(self, layer: int, keys: bool, values: bool) -> None:
        """Read ``layer`` and the layers after it, up to ``READ_BYTES``, in one device call:
        scorers read every layer anyway, and one call spreads the layers over the host's
        threads (or one graph) instead of paying a start-up per layer."""
        eng = self._live()
        per_layer = 4 * self.n_cells * self.n_kv_head * (keys * self.head_dim_k + values * self.head_dim_v)
        stop = layer + 1
        while (stop < min(self.n_layer, layer + READ_BYTES // max(per_layer, 1))
               and not (keys and (stop in self._k or stop in self._read_k))
               and not (values and (stop in self._v or stop in self._read_v))):
            stop += 1  # up to the first layer already read
        layers = range(layer, stop)
        k, v = eng.read(layers, cell_order=True, keys=keys, values=values, unrotated=True)
        for i, at in enumerate(layers):
            if k is not None:
                self._read_k[at] = k[i]
            if v is not None:
                self._read_v[at] = v[i]

    def _key_sqnorms(self, layer: int) -> None:
        """Every layer's sums in one device graph: a few ms where a read costs tens."""
        self._sqn.update(enumerate(self._live().key_sqnorms(cell_order=True)[:, :, self.order]))

    def _attention(self, layer: int, q: np.ndarray, q_pos: np.ndarray) -> np.ndarray:
        return self._attention_layers([layer], q, q_pos)[0]

    def _attention_layers(self, layers: list[int], q: np.ndarray, q_pos: np.ndarray) -> list[np.ndarray]:
        eng = self._live()
        if self._rotated is None or self._rotated[0] is not q:  # the window's queries, rotated once for all layers
            self._rotated = (q, eng.rotate_queries(q))
        out = eng.score(self._rotated[1], q_pos, self.kq_scale, layers=layers, rotated=True)
        return [out[layer] for layer in layers]

    def value_norms(self, layer: int) -> np.ndarray | None:
        with self._lock:
            if self._vnorms is None:
                try:
                    self._vnorms = self._live().value_norms(cell_order=True)[:, :, self.order]
                except NativeUnsupported:  # a cache outside host memory: the method reads V
                    self._vnorms = np.empty(0)
            return self._vnorms[layer].T if self._vnorms.size else None

    def lag_scores(self, members: np.ndarray) -> np.ndarray | None:
        eng = self._live()
        try:
            cells = members if self.in_order else np.where(members >= 0, self.order[np.maximum(members, 0)], -1)
            return eng.lag_scores(cells)
        except NativeUnsupported:  # a cache outside host memory
            return None
