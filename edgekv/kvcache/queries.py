"""The observation window: the newest queries, and the attention they pay to the cache.

SnapKV, ChunkKV and their kin rank cached tokens by how much attention the
newest queries give them. llama.cpp does not keep queries, so the engine asks
the context's tensor capture (``edgekv/capture.py``) for every compressible
layer's post-RoPE ``Qcur`` and keeps the newest ``size`` of them here after
each decode. The window is part of the cache state: ``save()``/``restore()``
and session files carry it, so a prefill saved once can be compressed by any
attention method later.

``window_attention`` is the score both engines must agree on, written once in
numpy: per KV head, the sum over window queries and the query heads of its
GQA group of softmax(kq_scale * q.k + bias), causal by cell position (a query
at position p sees the cells at positions <= p, as llama.cpp's mask does). The
native engine computes the same on the device (``NativeEngine.score``).
"""

from __future__ import annotations

import numpy as np

from ..capture import Capture
from ..errors import EdgekvError
from .rope import Rope


class QueryWindow:
    """Post-RoPE queries of the newest ``size`` decoded tokens, per compressible layer.

    ``layers[i]`` is the model layer of row i (all layers, or Gemma 3's global
    layers: the rows line up with a snapshot's layers). ``q`` is float32
    [len(layers), n_head, n, head_dim_k], oldest first; ``pos`` their positions.
    Stored as a ring, so recording one decoded token writes one column instead
    of moving the whole window.
    """

    def __init__(self, size: int, layers: tuple[int, ...], q: np.ndarray, pos: np.ndarray) -> None:
        if size < 1:
            raise EdgekvError(f"a query window holds at least one query, got size {size}")
        q = np.asarray(q, np.float32)
        pos = np.asarray(pos, np.int32)
        self.size = int(size)
        self.layers = tuple(int(x) for x in layers)
        k = min(self.size, pos.shape[0])
        self._q = np.zeros(q.shape[:2] + (self.size,) + q.shape[3:], np.float32)
        self._pos = np.zeros(self.size, np.int32)
        self._q[:, :, :k] = q[:, :, q.shape[2] - k:]
        self._pos[:k] = pos[pos.shape[0] - k:]
        self._next = k % self.size  # the ring slot the next query goes to
        self._count = k

    @classmethod
    def empty(cls, size: int, layers: tuple[int, ...], n_head: int, head_dim: int) -> QueryWindow:
        return cls(size, layers, np.zeros((len(layers), n_head, 0, head_dim), np.float32), np.zeros(0, np.int32))

    @property
    def n(self) -> int:
        return self._count

    @property
    def n_head(self) -> int:
        return int(self._q.shape[1])

    def _order(self) -> np.ndarray:
        return (self._next - self._count + np.arange(self._count)) % self.size

    @property
    def q(self) -> np.ndarray:
        return self._q[:, :, self._order()]

    @property
    def pos(self) -> np.ndarray:
        return self._pos[self._order()]

    def record(self, capture: Capture, start_pos: int, n_tokens: int, *, want_all: bool = False,
               first: int = 0, batch: int | None = None) -> np.ndarray | None:
        """Append what the last decode (``n_tokens`` at ``start_pos``..) computed; with
        ``want_all``, also return all of its queries, [rows, n_head, n_tokens, d]. A decode
        of several sequences' tokens (``batch`` of them, ``edgekv.lanes``) holds this one's
        from token ``first`` on."""
        batch = n_tokens if batch is None else batch
        keep = min(n_tokens, self.size)
        slots = (self._next + np.arange(keep)) % self.size
        every = np.empty((len(self.layers), self.n_head, n_tokens, self._q.shape[3]), np.float32) if want_all else None
        for row, il in enumerate(self.layers):
            t = capture.get("Qcur", il)
            if t is None or t.shape[1] != batch:
                raise EdgekvError(f"the query capture missed layer {il} of the last decode "
                                  f"({'nothing' if t is None else t.shape[1]} of {batch} tokens)")
            mine = t[0, first : first + n_tokens]  # [n_tokens, n_head, d]
            # the newest ``keep`` as [n_head, keep, d]
            self._q[row][:, slots] = mine[n_tokens - keep:].transpose(1, 0, 2)
            if every is not None:
                every[row] = mine.transpose(1, 0, 2)
        self._pos[slots] = np.arange(start_pos + n_tokens - keep, start_pos + n_tokens, dtype=np.int32)
        self._next = int((self._next + keep) % self.size)
        self._count = min(self.size, self._count + keep)
        return every

    def clear(self) -> None:
        self._next = self._count = 0

    def copy(self) -> QueryWindow:
        return self.resized(self.size)

    def resized(self, size: int) -> QueryWindow:
        """The same queries in a window of ``size`` (the newest ones if it shrinks)."""
        return QueryWindow(size, self.layers, self.q, self.pos)

    def last(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(q [rows, n_head, m, d], pos [m]) of the newest m = min(n, held) queries."""
        if self._count == 0:
            raise EdgekvError("no queries were recorded: the method needs the observation window "
                              "from the tokens it compresses (observe before decoding them)")
        m = min(n, self._count)
        order = self._order()[self._count - m:]
        # contiguous once here: numpy gathers along a middle axis into a strided array, and the
        # score op copied it again on each of a scorer's per-layer calls (30 copies of 4 MiB at 8k)
        return np.ascontiguousarray(self._q[:, :, order]), self._pos[order]


class QueryMoments:
    """Running first and second moments of every recorded query *before* RoPE, per
    compressible layer and query head: what Expected Attention predicts future queries
    from.

    llama.cpp hands over post-RoPE queries; each is rotated back by its own position
    (``rope``; rows in ``nope_rows``, layers built without RoPE, are taken as they are).
    Queries of the first ``skip`` token positions are left out: attention sinks' queries
    are outliers (kvpress drops them too). Unrotated queries carry no position, so
    compactions, shifts and renumbering leave the moments valid; memory is
    O(rows x heads x d^2) however long the context. ``total`` float64 [rows, n_head, d],
    ``outer`` float64 [rows, n_head, d, d] (sums of q q^T), ``count`` queries summed.
    """

    SKIP = 4  # kvpress's n_sink

    def __init__(self, rope: Rope | None, layers: tuple[int, ...], nope_rows: frozenset[int], total: np.ndarray,
                 outer: np.ndarray, count: int, skip: int = SKIP) -> None:
        self.rope, self.layers, self.nope_rows, self.skip = rope, tuple(layers), frozenset(nope_rows), int(skip)
        self.total = np.asarray(total, np.float64)
        self.outer = np.asarray(outer, np.float64)
        self.count = int(count)

    @classmethod
    def zeros(cls, rope: Rope, layers: tuple[int, ...], nope_rows: frozenset[int], n_head: int,
              head_dim: int) -> QueryMoments:
        return cls(rope, layers, nope_rows, np.zeros((len(layers), n_head, head_dim)),
                   np.zeros((len(layers), n_head, head_dim, head_dim)), 0)

    def add(self, q: np.ndarray, pos: np.ndarray, token_pos: np.ndarray) -> None:
        """Add one decode's post-RoPE queries ``q`` [rows, n_head, m, d], rotated at llama
        positions ``pos`` [m], of the tokens at ``token_pos`` [m]."""
        use = np.asarray(token_pos) >= self.skip
        if not use.any():
            return
        pre = np.asarray(q, np.float32)[:, :, use]
        roped = [r for r in range(pre.shape[0]) if r not in self.nope_rows]
        if roped:
            if self.rope is None:
                raise EdgekvError("these query statistics were loaded without the model's RoPE "
                                  "(restore them into an engine)")
            back = -np.asarray(pos, np.int64)[use]
            pre[roped] = self.rope.rotate(pre[roped], np.broadcast_to(back, (len(roped),) + pre.shape[1:3]))
        self.total += pre.sum(axis=2, dtype=np.float64)
        self.outer += np.matmul(pre.transpose(0, 1, 3, 2), pre).astype(np.float64)
        self.count += int(use.sum())

    def mean_cov(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """(mean [n_head, d], covariance [n_head, d, d]) of the pre-RoPE queries of one row,
        the population covariance (divided by the count), as kvpress takes it."""
        if self.count == 0:
            raise EdgekvError("no queries were recorded beyond the first tokens: Expected Attention "
                              "needs the statistics of the queries it predicts from")
        mu = self.total[row] / self.count
        return mu, self.outer[row] / self.count - mu[:, :, None] * mu[:, None, :]

    def future_rotation(self, row: int, first: int, n: int) -> np.ndarray:
        """float64 [d, d]: RoPE's rotation averaged over the llama positions first..first+n-1
        (the identity for a row without RoPE), R with R q the rotation of a column q."""
        d = self.total.shape[2]
        if row in self.nope_rows:
            return np.eye(d)
        if self.rope is None:
            raise EdgekvError("these query statistics were loaded without the model's RoPE (restore them into an engine)")
        return self.rope.mean_rotation(first, n, d)

    def clear(self) -> None:
        self.total[:] = 0.0
        self.outer[:] = 0.0
        self.count = 0

    def load(self, saved: QueryMoments) -> None:
        """Take a saved state's sums (a session file carries no RoPE: this engine's stays)."""
        if saved.layers != self.layers or saved.total.shape != self.total.shape:
            raise EdgekvError("saved query statistics do not match this model's layers and heads")
        self.total, self.outer = saved.total.copy(), saved.outer.copy()
        self.count, self.skip = saved.count, saved.skip

    def copy(self) -> QueryMoments:
        return QueryMoments(self.rope, self.layers, self.nope_rows, self.total.copy(), self.outer.copy(),
                            self.count, self.skip)


class AttentionTally:
    """Attention accumulated by every cell from every query decoded since the tally
    started (H2O's heavy-hitter score): float64 [rows, n_kv_head, n_cells], cells in
    position order, rows as the query window's. Compactions gather it like the
    cells; cells decoded before the tally started count zero.

    Two ways in: ``add`` takes attention already in position order (scored again over
    the cache); ``add_cells`` takes what llama.cpp's own softmax paid, captured as the
    model decoded, in the cache's cell order. Those wait in ``pending`` until ``fold``
    is told the cells' positions (which a snapshot or a compaction reads anyway), so a
    decode needs no read of the cache at all."""

    def __init__(self, scores: np.ndarray, complete: bool = True) -> None:
        self.scores = np.asarray(scores, np.float64)
        # False when cells were decoded without their queries being tallied (the tally
        # started late, or recording failed): H2O refuses such a tally
        self.complete = complete
        self.pending: np.ndarray | None = None  # float64 [rows, H, width]: by cell index, since the last fold
        self._seen: np.ndarray | None = None  # the cells the last captured decode saw, in cell order

    @classmethod
    def zeros(cls, rows: int, n_kv_head: int, n_cells: int) -> AttentionTally:
        return cls(np.zeros((rows, n_kv_head, n_cells)), complete=n_cells == 0)

    @property
    def n_cells(self) -> int:
        return int(self.scores.shape[2])

    def add(self, attention: np.ndarray) -> None:
        """Add one decode's window attention over the cells after it ([rows, H, n] with
        n >= the cells tallied so far: the decode's own cells come last)."""
        n = attention.shape[2]
        if n < self.n_cells:
            raise EdgekvError(f"attention over {n} cells cannot extend a tally of {self.n_cells}")
        grown = np.zeros(self.scores.shape[:2] + (n,))
        grown[:, :, : self.n_cells] = self.scores
        self.scores = grown + attention

    def add_cells(self, attention: np.ndarray, seen: np.ndarray) -> None:
        """Add one decode's attention as the model computed it: [rows, H, width], columns
        the cache's cells by index; ``seen``: the indices of the sequence's cells after the
        decode, ascending (what the mask let its last token see)."""
        w = attention.shape[2]
        if self.pending is None:
            self.pending = np.zeros(attention.shape)
        elif w > self.pending.shape[2]:
            self.pending = np.concatenate([self.pending, np.zeros(self.pending.shape[:2] + (w - self.pending.shape[2],))],
                                          axis=2)
        self.pending[:, :, :w] += attention
        self._seen = np.asarray(seen)

    def fold(self, cell_pos: np.ndarray) -> None:
        """Put what ``add_cells`` gathered into position order: ``cell_pos`` are the
        positions of the sequence's cells in cell order, as llama.cpp holds them now. The
        cells added since the last fold have the latest positions and come last. If the
        capture's cells and llama.cpp's disagree, the tally cannot be placed: it is zeroed
        and marked incomplete (H2O then refuses it) rather than guessed."""
        if self.pending is None:
            return
        pending, seen = self.pending, self._seen
        self.pending = self._seen = None
        n = int(np.asarray(cell_pos).shape[0])
        if seen is None or seen.shape[0] != n or n < self.n_cells or (n and seen[-1] >= pending.shape[2]):
            self.scores = np.zeros(self.scores.shape[:2] + (n,))
            self.complete = False
            return
        self.add(pending[:, :, seen][:, :, np.argsort(cell_pos, kind="stable")])

    def grow(self, n: int) -> None:
        """Cells decoded without their attention tallied: zeros, and the tally is incomplete."""
        if n > self.n_cells:
            self.add(np.zeros(self.scores.shape[:2] + (n,)))
            self.complete = False

    def compact(self, keep: np.ndarray) -> None:
        """The cells ``keep`` [rows, H, B] (or [B], the same for all) kept, in that order."""
        if self.pending is not None:
            raise EdgekvError("the tally holds captured attention not yet placed (fold it before a compaction)")
        keep = np.asarray(keep)
        if keep.ndim == 1:
            self.scores = self.scores[:, :, keep]
        else:
            self.scores = np.take_along_axis(self.scores, keep, axis=2)

    def clear(self) -> None:
        self.scores = self.scores[:, :, :0]
        self.complete = True
        self.pending = self._seen = None

    def copy(self) -> AttentionTally:
        out = AttentionTally(self.scores.copy(), self.complete)
        if self.pending is not None:
            out.pending, out._seen = self.pending.copy(), self._seen
        return out


def window_attention(q: np.ndarray, q_pos: np.ndarray, k: np.ndarray, k_pos: np.ndarray, kq_scale: float,
                     bias: np.ndarray | None = None) -> np.ndarray:
    """float64 [n_kv_head, n]: attention of the window queries to each cached key.

    ``q`` [n_head, n_q, d] (one layer), ``k`` [n, n_kv_head, d], ``bias`` [n_kv_head, n]
    (the merge's log-count bias) or None. Query head ``qh`` reads KV head
    ``qh // (n_head / n_kv_head)``; every query's softmax row sums to 1 over the
    cells it sees, and a KV head's score sums its group's rows.
    """
    n_head, n_q, d = q.shape
    n, n_kv, _ = k.shape
    if n_head % n_kv:
        raise EdgekvError(f"{n_head} query heads do not split into {n_kv} KV heads")
    group = n_head // n_kv
    kf = k.astype(np.float32)
    out = np.zeros((n_kv, n))
    step = max(1, (1 << 22) // max(1, n * n_head))  # queries per block: about 4M logits at a time
    for t0 in range(0, n_q, step):
        qb, pb = q[:, t0 : t0 + step], q_pos[t0 : t0 + step]
        m = qb.shape[1]
        qg = qb.reshape(n_kv, group * m, d).astype(np.float32)
        logits = np.einsum("hqd,nhd->hqn", qg, kf, optimize=True).astype(np.float64) * kq_scale
        if bias is not None:
            logits += bias[:, None, :]
        hidden = np.tile(k_pos[None, :] > pb[:, None], (group, 1))  # [group*m, n]
        logits[:, hidden] = -np.inf
        logits -= logits.max(axis=2, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=2, keepdims=True)
        out += p.sum(axis=1)
    return out
