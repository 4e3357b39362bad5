"""The portable engine: llama.cpp's per-sequence state API, parsed and rewritten in numpy.

Works with any stock libllama: ``llama_state_seq_get_data`` hands over the
sequence's cells as bytes (``layout.py`` parses them), a compaction gathers
rows per (layer, KV head) and ``llama_state_seq_set_data`` takes the rebuilt
blob back. The native engine (``native.py``) does the same where the cache
lives and falls back to this one where its ops cannot serve.
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import EdgekvError, StateLayoutError
from ..llama import Context
from . import layout
from .cells import (
    TokenMap,
    average_rows,
    check_keep,
    check_merge,
    compacted_positions,
    merge_groups,
    merge_keep,
    merged_counts,
)
from .engine import CacheState
from .quant import dequantize, quantize, row_size
from .queries import AttentionTally, QueryMoments, QueryWindow, window_attention
from .rope import Rope
from .snapshot import HostSnapshot, KVSnapshot, unrotate


class StateEngine:
    """KV engine over ``llama_state_seq_get_data`` / ``set_data`` (any stock libllama)."""

    name = "state"

    def __init__(self, ctx: Context, seq: int = 0, tokens: TokenMap | None = None) -> None:
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
        # shared with the native engine when it uses this one as its fallback
        self.tokens = tokens if tokens is not None else TokenMap(self.n_kv_head)
        # the layers a snapshot holds: all, or only the full-attention ones of an iSWA model
        self.layers = ctx.model.info.global_layers if self.n_caches > 1 else tuple(range(arch.n_layer))
        self.window: QueryWindow | None = None
        self.tally: AttentionTally | None = None
        self.moments: QueryMoments | None = None  # pre-RoPE query statistics (Expected Attention)
        # how a decode's queries become attention over the cells (the native engine puts its device op here)
        self.attention = self.host_attention
        # H2O's tally from llama.cpp's own softmax, reduced as it is computed (``tally_from_softmax``)
        self._softmax_tally = False
        # "merge": numpy over the blob; "queries": the context's tensor capture can record
        # the observation window
        self.capabilities = frozenset({"merge", "queries"} if ctx.capture is not None else {"merge"})
        # llama.cpp applies a context shift's K-shift at the next decode, and its state blob
        # does not carry a pending one: rewriting the blob before then would lose it
        self._shift_pending = False

    # -- accounting ------------------------------------------------------------
    @property
    def n_cells(self) -> int:
        return self.tokens.n_cells

    def decode(self, tokens: list[int], start_pos: int, *, all_logits: bool = False) -> None:
        """Decode tokens at start_pos.. into the sequence and count the cells they take."""
        if self._softmax_tally:  # the softmax sums add up over evaluations: start this decode's afresh
            self.ctx.capture.clear()
        self.ctx.decode(tokens, start_pos, all_logits=all_logits, seq=self.seq)
        self.decoded(tokens, start_pos)

    def decoded(self, tokens: list[int], start_pos: int, *, first: int = 0, batch: int | None = None) -> None:
        """Count the cells a decode put into the sequence and record its queries: after this
        engine's ``decode``, or a decode of several sequences' tokens (``edgekv.lanes``: a
        ``batch`` of them, this sequence's from token ``first`` on)."""
        self._shift_pending = False
        self.tokens.n_cells += len(tokens)
        self.tokens.record(start_pos + self.tokens.pos_shift, tokens)
        if self.window is None:
            return
        try:
            every = (self.tally is not None and not self._softmax_tally) or self.moments is not None
            q = self.window.record(self.ctx.capture, start_pos, len(tokens), want_all=every, first=first, batch=batch)
            at = np.arange(start_pos, start_pos + len(tokens), dtype=np.int32)
            if self.tally is not None and self._softmax_tally:
                self.tally.add_cells(*self._softmax_attention())
            elif self.tally is not None:
                self.tally.add(self.attention(q, at))
            if self.moments is not None:
                self.moments.add(q, at, at + self.tokens.pos_shift)
        except Exception:
            # the cells are in; what was recorded of them is not trustworthy
            self.window.clear()
            if self.tally is not None:
                self.tally.grow(self.n_cells)
                self.tally.complete = False
            raise

    def cell_positions(self) -> np.ndarray:
        """Positions of the sequence's cells in cell order (the columns of llama.cpp's KQ)."""
        return self._parse().sections[0].pos.copy()

    def tally_from_softmax(self) -> bool:
        """Whether H2O's tally can come from the decode's own attention softmax, captured and
        summed as llama.cpp computes it, instead of scoring each decode's queries again over a
        read of the cache. Flash attention never forms the softmax, so it keeps the scoring;
        ``EDGEKV_TALLY=rescore`` asks for the scoring anyway (the benchmarks compare the two)."""
        return self.ctx.flash_attn == "off" and os.environ.get("EDGEKV_TALLY", "") != "rescore"

    def _softmax_attention(self) -> tuple[np.ndarray, np.ndarray]:
        """The last decode's attention per (row, KV head, cell index), its query heads'
        softmax summed over its tokens and over each KV head's GQA group, and the cells of
        the sequence (what the mask let the last token see)."""
        group = self.ctx.model.arch.n_head // self.n_kv_head
        rows, seen = [], None
        for il in self.layers:
            got = self.ctx.capture.column_sums("kq_soft_max", il)
            if got is None:
                raise EdgekvError(f"the attention capture missed layer {il} of the last decode")
            sums, vis = got
            rows.append(sums.reshape(self.n_kv_head, group, -1).sum(axis=1, dtype=np.float64))
            seen = vis if seen is None else seen
        width = max(r.shape[1] for r in rows)
        out = np.zeros((len(rows), self.n_kv_head, width))
        for r, a in enumerate(rows):
            out[r, :, : a.shape[1]] = a
        return out, seen

    def fold_tally(self, cell_pos: np.ndarray) -> None:
        """Place the captured attention (``AttentionTally.fold``) given the cells' positions
        in cell order: before the tally is read or the cells move."""
        if self.tally is not None:
            self.tally.fold(cell_pos)

    def host_attention(self, q: np.ndarray, q_pos: np.ndarray) -> np.ndarray:
        """[rows, H, n]: window attention of ``q`` over the cells, in numpy over a snapshot
        (also what the native engine falls back to where its score op cannot run)."""
        snap = self.snapshot()
        return np.stack([window_attention(q[r], q_pos, snap.keys(r), snap.pos, snap.kq_scale, snap.log_counts(r))
                         for r in range(snap.n_layer)])

    def observe(self, size: int, *, tally: bool = False, moments: bool = False) -> None:
        """Keep the post-RoPE queries of the newest ``size`` decoded tokens (0: stop), with
        ``tally`` the attention every cell accumulates from every later query (H2O), and
        with ``moments`` the statistics of every query before RoPE (Expected Attention).

        Only tokens decoded from now on are recorded (cells already there tally zero);
        a larger window keeps what it has, and a tally or moments already kept stay."""
        if size <= 0:
            if self.window is not None:
                self.ctx.capture.want("Qcur", self.layers, on=False)
            if self._softmax_tally:
                self.ctx.capture.want_sums("kq_soft_max", self.layers, on=False)
                self._softmax_tally = False
            self.window = None
            self.tally = None
            self.moments = None
            return
        if "queries" not in self.capabilities:
            raise EdgekvError("this context has no tensor capture to record queries "
                              "(edgekv/_edgekv_capture*.so is not built: run native/build_native.py)")
        info = self.ctx.model.info
        if info.attn_logit_softcap:
            raise EdgekvError("attention-scored methods do not model logit soft-capping "
                              f"({info.arch}); use an attention-free method")
        if info.attn_sinks:
            raise EdgekvError("attention-scored methods do not model learned attention sinks "
                              f"({info.arch}); use an attention-free method")
        if info.positions == "alibi":
            raise EdgekvError("attention-scored methods do not model ALiBi's distance bias "
                              f"({info.arch}); use an attention-free method")
        stats = self._new_moments() if moments and self.moments is None else None  # may refuse: before any change
        if self.window is None:
            arch = self.ctx.model.arch
            self.ctx.capture.want("Qcur", self.layers)
            self.window = QueryWindow.empty(size, self.layers, arch.n_head, self.head_dim_k)
        elif size != self.window.size:
            self.window = self.window.resized(size)
        if tally and self.tally is None:
            self.tally = AttentionTally.zeros(len(self.layers), self.n_kv_head, self.n_cells)
            if self.tally_from_softmax():
                self.ctx.capture.want_sums("kq_soft_max", self.layers)
                self._softmax_tally = True
        if stats is not None:
            self.moments = stats

    def _new_moments(self) -> QueryMoments:
        """Empty query statistics; a model whose queries carry no rotation (learned or no
        positions) needs none undone, one whose RoPE edgekv does not reproduce is refused."""
        model = self.ctx.model
        if model.arch.rope_type < 0:
            return QueryMoments.zeros(None, self.layers, frozenset(range(len(self.layers))), model.arch.n_head,
                                      self.head_dim_k)
        rope = Rope.of(model, "recording queries before RoPE (Expected Attention)", "use another method")
        rows = frozenset(r for r, il in enumerate(self.layers) if il in model.info.nope_layers)
        return QueryMoments.zeros(rope, self.layers, rows, model.arch.n_head, self.head_dim_k)

    def shift(self, n_keep: int, n_discard: int, cell_pos: np.ndarray | None = None) -> int:
        """llama.cpp's context shift on this sequence: drop cells n_keep..n_keep+n_discard-1
        (token order) and move the later ones down by n_discard positions. Returns
        the position delta. Only valid on a cache whose cells are whole tokens
        (never compacted per head), which the caller guarantees. It needs only the
        cells' positions (``cell_pos``, in cell order, where the caller has them
        cheaper than a parse of the state blob), never the keys or values."""
        if self.tokens.counts is not None:
            raise EdgekvError("context shift needs an unmerged cache (merged cells stand for several tokens)")
        cell_pos = self.cell_positions() if cell_pos is None else cell_pos
        self.fold_tally(cell_pos)
        pos = np.sort(cell_pos, kind="stable")
        n_layer = len(self.layers)
        token_pos = self.tokens.full(pos, n_layer)
        if not np.all(token_pos == token_pos[:1, :1]):
            raise EdgekvError("context shift needs an uncompacted cache (same tokens in every head)")
        p0, p1 = int(pos[n_keep]), int(pos[n_keep + n_discard])
        delta = p1 - p0
        if not self.ctx.seq_rm(self.seq, p0, p1):
            raise EdgekvError("llama.cpp refused to remove the shifted range")
        self.ctx.seq_add(self.seq, p1, -1, -delta)
        keep = np.concatenate([np.arange(n_keep), np.arange(n_keep + n_discard, pos.shape[0])])
        rot = self.tokens.full_rot(pos, n_layer)[:, :, keep]
        rot[:, :, n_keep:] -= delta  # llama.cpp's K-shift moves these keys down
        self.tokens.set(token_pos[:, :, keep], rot=rot)
        self.tokens.pos_shift += delta
        self._shift_pending = True
        if self.tally is not None:
            self.tally.compact(keep)
        if self.window is not None:  # its positions and RoPE phases belong to the old numbering
            self.window.clear()
        return delta

    def renumber(self) -> int:
        """Give the cells the positions 0..n-1 and re-rotate every (layer, head)'s keys by
        its own distance (layers the model builds without RoPE keep theirs), so each head sees the tokens it kept as one contiguous run
        (StreamingLLM's renumbering, exact for a per-head cache). Returns the position
        delta for the next token. Methods still see original token positions; the
        observation window is cleared (its queries carry the old rotation)."""
        rope = Rope.of(self.ctx.model)  # refuses what it cannot reproduce before anything changes
        self._writable()
        st = self._parse()
        sec = st.sections[0]
        self.fold_tally(sec.pos)
        n, n_layer, H, dk = sec.n_cells, len(sec.layers), self.n_kv_head, self.head_dim_k
        if n == 0:
            return 0
        order = np.argsort(sec.pos, kind="stable")
        pos = sec.pos[order]
        token_pos = self.tokens.full(pos, n_layer)
        counts = self.tokens.full_counts(n_layer, n)
        delta = np.empty((n_layer, H, n), np.int64)
        delta[..., order] = np.arange(n) - self.tokens.full_rot(pos, n_layer)  # cell order, as the blob holds them
        nope = self.ctx.model.info.nope_layers  # keys without RoPE carry no position to move
        for il, ld in enumerate(sec.layers):
            if il in nope or not delta[il].any():
                continue
            raw = np.array(ld.k).reshape(n, H, -1)
            for h in range(H):  # only the heads that move: a re-quantisation is not free
                rows = np.flatnonzero(delta[il, h])
                if rows.size:
                    k = unrotate(dequantize(raw[rows, h], ld.k_type, dk), self.ctx.k_rot)
                    raw[rows, h] = quantize(unrotate(rope.rotate(k, delta[il, h, rows]), self.ctx.k_rot), ld.k_type)
            ld.k = raw.reshape(n, -1)
        new_pos = np.empty(n, np.int32)
        new_pos[order] = np.arange(n, dtype=np.int32)
        sec.pos = new_pos
        self.ctx.state_set(layout.write_seq_state(st), self.seq)
        moved = int(pos[-1]) + 1 - n
        self.tokens.set(token_pos, counts, rot=np.broadcast_to(np.arange(n, dtype=np.int32), token_pos.shape))
        self.tokens.pos_shift += moved
        if self.window is not None:
            self.window.clear()
        return -moved

    def shift_applied(self) -> None:
        """llama.cpp has applied the pending K-shift outside a decode (the native engine's
        ``llama_edgekv_shift_apply``): the state blob carries the shifted keys again."""
        self._shift_pending = False

    def reset(self) -> None:
        """Empty the sequence (llama.cpp's cells and the token map)."""
        self.ctx.seq_rm(self.seq, -1, -1)
        self._shift_pending = False
        self.tokens.reset()
        if self.window is not None:
            self.window.clear()
        if self.tally is not None:
            self.tally.clear()
        if self.moments is not None:
            self.moments.clear()

    def _writable(self) -> None:
        if self._shift_pending:
            raise EdgekvError("the cache has a context shift llama.cpp applies at the next decode, which its "
                              "state blob does not carry; decode before compacting, merging, renumbering or saving")

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
        if sec.n_cells != self.n_cells:
            raise StateLayoutError(
                f"llama.cpp holds {sec.n_cells} cells for the sequence, the engine counted {self.n_cells}"
            )
        return st

    def snapshot(self) -> KVSnapshot:
        st = self._parse()
        sec = st.sections[0]
        self.fold_tally(sec.pos)
        order = np.argsort(sec.pos, kind="stable")
        pos = sec.pos[order]
        return HostSnapshot(
            pos=pos,
            token_pos=self.tokens.full(pos, len(sec.layers)),
            n_kv_head=self.n_kv_head,
            head_dim_k=self.head_dim_k,
            head_dim_v=self.head_dim_v,
            queries=self.window.copy() if self.window is not None else None,
            kq_scale=self.ctx.model.info.kq_scale,
            tally=self.tally.scores.copy() if self.tally is not None and self.tally.complete else None,
            moments=self.moments.copy() if self.moments is not None else None,
            counts=self.tokens.full_counts(len(sec.layers), sec.n_cells),
            section=sec,
            order=order,
            k_rot=self.ctx.k_rot,
            v_rot=self.ctx.v_rot,
        )

    # -- verbs -----------------------------------------------------------------
    def compact(self, keep: np.ndarray) -> None:
        self._writable()
        self._whole_tokens_under_alibi(keep)
        st = self._parse()
        sec = st.sections[0]
        self.fold_tally(sec.pos)
        order = np.argsort(sec.pos, kind="stable")
        pos = sec.pos[order]
        keep = check_keep(keep, len(sec.layers), self.n_kv_head, sec.n_cells)
        st.sections[0] = layout.gather_section(sec, order, keep, compacted_positions(pos, keep), self.n_kv_head)
        self.ctx.state_set(layout.write_seq_state(st), self.seq)
        self.compacted(pos, keep)

    def _whole_tokens_under_alibi(self, keep: np.ndarray) -> None:
        """ALiBi reads each cell's one position: a compaction that keeps different tokens per
        head is exact only with the native engine's per-cell bias (``NativeEngine._apply_bias``)."""
        keep = np.asarray(keep)
        if self.ctx.model.info.positions == "alibi" and keep.ndim == 3 and not np.all(keep == keep[:1, :1]):
            raise EdgekvError(f"ALiBi ({self.ctx.model.info.arch}): keeping different tokens per head needs the "
                              "native engine's per-cell bias to stay exact; the state engine keeps whole tokens "
                              "only (streaming_llm, context_shift)")

    def compacted(self, pos: np.ndarray, keep: np.ndarray) -> None:
        """Bring the host's bookkeeping (the token map, H2O's tally) in line with a compaction
        of the cells at positions ``pos`` to ``keep``, whichever engine moved the bytes."""
        self.tokens.compacted(pos, keep.shape[0], keep)
        if self.tally is not None:
            self.tally.compact(keep)

    def merge(self, src: np.ndarray, dst: np.ndarray, *, bias: bool) -> None:
        """Fold each source cell into its destination, per (layer, KV head): count-weighted
        means of K and V, re-quantised into the cache's type (in its own, possibly
        Hadamard-rotated, space: averaging commutes with the rotation); then drop the
        sources. The counts stay on the host; attention here cannot weigh them."""
        if bias:
            raise EdgekvError("attention that weighs merged cells by their counts (the log-count bias) needs "
                              "the native engine; the state engine merges without it")
        if self.ctx.model.info.positions == "alibi":
            raise EdgekvError(f"ALiBi ({self.ctx.model.info.arch}): a merged cell holds tokens of several "
                              "positions, which needs the native engine's bias (chelsea) to stay exact")
        self._writable()
        st = self._parse()
        sec = st.sections[0]
        self.fold_tally(sec.pos)
        order = np.argsort(sec.pos, kind="stable")
        pos = sec.pos[order]
        n, n_layer, H = sec.n_cells, len(sec.layers), self.n_kv_head
        src, dst = check_merge(src, dst, n_layer, H, n)
        old = self.tokens.full_counts(n_layer, n)
        old = np.ones((n_layer, H, n), np.float32) if old is None else old
        merged = {}
        groups = merge_groups(src, dst)
        for il, h in np.ndindex(n_layer, H):
            dsts, ks, vs = [], [], []
            for g in (g[il, h] for g in groups):
                g = g[g[:, 1] >= 0]  # real groups only, not the padding
                if not g.size:
                    continue
                cells = np.where(g >= 0, g, g[:, :1])
                w = np.where(g >= 0, old[il, h][cells], 0.0)
                k, v = layout.head_rows(sec, il, h, order[cells.ravel()], H, self.head_dim_k, self.head_dim_v)
                ks.append(average_rows(k.reshape(*g.shape, -1), w))
                vs.append(average_rows(v.reshape(*g.shape, -1), w))
                dsts.append(g[:, 0])
            merged[il, h] = (np.concatenate(dsts), np.concatenate(ks), np.concatenate(vs))
        keep = merge_keep(src, n)
        new = layout.gather_section(sec, order, keep, compacted_positions(pos, keep), H)
        for (il, h), (d, k, v) in merged.items():
            layout.set_head_rows(new, il, h, np.searchsorted(keep[il, h], d), k, v, H)
        st.sections[0] = new
        self.ctx.state_set(layout.write_seq_state(st), self.seq)
        self.tokens.set(self.tokens.full(pos, n_layer), merged_counts(old, src, dst, n),
                        rot=self.tokens.full_rot(pos, n_layer))
        self.compacted(pos, keep)

    def save(self) -> CacheState:
        self._writable()
        blob = self.ctx.state_get(self.seq)
        st = layout.parse_seq_state(blob, n_caches=self.n_caches, n_layers=None)
        sec = st.sections[0]
        self.fold_tally(sec.pos)
        pos = np.sort(sec.pos)
        token_pos, rot = self.tokens.full(pos, len(sec.layers)), self.tokens.full_rot(pos, len(sec.layers))
        return CacheState(blob=blob, token_pos=token_pos, engine=self.name,
                          counts=self.tokens.full_counts(len(sec.layers), sec.n_cells),
                          rot=None if np.array_equal(rot, token_pos) else rot, pos_shift=self.tokens.pos_shift,
                          ids=self.tokens.ids.copy(),
                          window=self.window.copy() if self.window is not None else None,
                          tally=(self.tally.scores.astype(np.float32)
                                 if self.tally is not None and self.tally.complete else None),
                          moments=self.moments.copy() if self.moments is not None else None)

    def _in_our_streams(self, st: layout.SeqState, blob: bytes | bytearray) -> bytes | bytearray:
        """The blob as this context lays out its streams: llama.cpp refuses a state written
        with another stream count (a session saved in a context of several sequences, see
        ``edgekv.lanes``, loaded into one of its own, or back), and places the cells in the
        stream of the sequence it loads them into."""
        n_stream = self.ctx.n_stream
        if all(sec.n_stream == n_stream for sec in st.sections):
            return blob
        for sec in st.sections:
            sec.n_stream, sec.stream = n_stream, self.seq if n_stream > 1 else 0
        return layout.write_seq_state(st)

    def restore(self, state: CacheState) -> None:
        # Validate before handing llama.cpp anything: it would replace the
        # sequence first and only then notice a mismatch.
        st = layout.parse_seq_state(state.blob, n_caches=self.n_caches, n_layers=None)
        if st.sections[0].n_cells != state.n_cells:
            raise StateLayoutError("saved state and its token map disagree on the cell count")
        _check_positions(st.sections[0].pos, state)
        if state.n_cells > self.ctx.n_ctx_seq:
            raise StateLayoutError(
                f"saved state holds {state.n_cells} cells, this context has {self.ctx.n_ctx_seq} per sequence"
            )
        if state.window is not None and state.window.layers != self.layers:
            raise StateLayoutError("saved query window does not match this model's layers")
        if state.tally is not None and state.tally.shape != (len(self.layers), self.n_kv_head, state.n_cells):
            raise StateLayoutError("saved attention tally does not match the saved cells")
        if state.moments is not None and (state.moments.layers != self.layers
                                          or state.moments.total.shape[2] != self.head_dim_k):
            raise StateLayoutError("saved query statistics do not match this model's layers")
        if state.counts is not None and (state.counts.shape != state.token_pos.shape
                                         or not np.all(np.isfinite(state.counts) & (state.counts >= 1))):
            raise StateLayoutError("saved merge counts do not match the saved cells or are not counts (>= 1)")
        if state.bias:
            raise EdgekvError("this state's merged cells are weighed by their counts in attention (the "
                              "log-count bias), which only the native engine applies")
        if state.rot is not None and state.rot.shape != state.token_pos.shape:
            raise StateLayoutError("saved key rotations do not match the saved cells")
        self.ctx.state_set(self._in_our_streams(st, state.blob), self.seq)
        self._shift_pending = False
        self.tokens.set(state.token_pos, state.counts, state.rot)
        self.tokens.pos_shift = state.pos_shift
        self.tokens.ids = (np.asarray(state.ids, np.int32).copy() if state.ids is not None
                           else np.full(0, -1, dtype=np.int32))
        if state.window is not None and self.window is None and "queries" in self.capabilities:
            # the state was recorded for an attention method: keep recording from it
            self.observe(state.window.size, tally=state.tally is not None, moments=state.moments is not None)
        if self.window is not None:  # an observing engine takes the saved queries (none: empty)
            w = self.window
            self.window = (state.window.resized(w.size) if state.window is not None
                           else QueryWindow.empty(w.size, w.layers, w.n_head, self.head_dim_k))
        if self.tally is not None:  # a tallying engine takes the saved tally (none: zeros)
            self.tally = (AttentionTally(state.tally) if state.tally is not None
                          else AttentionTally.zeros(len(self.layers), self.n_kv_head, state.n_cells))
        if self.moments is not None:  # so does one keeping query statistics (with its own RoPE)
            if state.moments is not None:
                self.moments.load(state.moments)
            else:
                self.moments.clear()


def _check_positions(pos: np.ndarray, state: CacheState) -> None:
    """A blob's cell positions must be >= 0 and, until a merge, shift or renumbering moved
    cells or keys off their tokens, at most the earliest token each cell holds: every
    compaction leaves a cell at the earliest position its cells had (``compacted_positions``).
    llama.cpp takes positions as they are, and a cell placed after a query is masked out of
    its attention: a position corrupted upwards is refused."""
    if not pos.size:
        return
    srt = np.sort(pos)
    if srt[0] < 0:
        raise StateLayoutError("saved state has cells at negative positions")
    if state.pos_shift == 0 and state.rot is None and state.counts is None:
        earliest = state.token_pos.reshape(-1, state.n_cells).min(axis=0)
        if np.any(srt > earliest):
            raise StateLayoutError("saved state has cells at later positions than the tokens they hold")
