"""LagKV ("LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important",
arXiv:2504.04704; notes in docs/methods.md).

Per (layer, KV head): the first ``sinks`` tokens stay; the rest of the
sequence is cut, on ORIGINAL token positions, into partitions of ``L`` tokens,
partition p = [S + pL, S + (p+1)L). A partition is scored once, against the
partition that follows it (the "lag" reference): every channel is min-max
normalised with the reference's per-channel min and max (Eqs. 5-7), each token
gets the standard deviation of its normalised vector across channels
(unbiased, as the authors' code), a softmax over the partition's L tokens
turns that into a score (Eq. 8), and the key and value scores are added
(Eq. 9). The top floor(r*L) tokens of the partition stay. The last complete
partition has no reference, so it and the remainder (< L tokens) form the
window of L..2L-1 recent tokens.

Incremental and stateless. A partition is compressed once, when its successor
is complete, and never rescored by the paper step. Which partitions are
already compressed is read from ``snap.token_pos`` alone: the newest tokens
are held intact (every position present in every head) back to some
position; partitions that start at or after it are uncompressed, those before
it are done. So save/restore and session files need no extra state, and the
kept set after any number of incremental steps equals a one-shot pass over
the same K/V (docs/methods.md, lagkv).

Budget conventions (session.py):

- ratio mode (``--ratio R``, fraction removed): the paper's method, r = 1 - R.
  Compressions follow LagKV's own schedule (``due``: whenever a partition's
  successor completes) and ignore the session's target, so the cache grows as
  Eq. 10 says. Only when the cache is full (the session calls ``select``
  without ``due`` having asked for it) is the target enforced, as below.
- budget mode (``--budget N``): r is the method's own field. The paper step
  runs whenever the cache exceeds N (lazily: until then nothing is lost).
  If the cache is still above N after it, the compressed partitions shrink
  uniformly ("water-filling"): every compressed partition keeps the same
  number of tokens, the fullest lose first, ties cost the OLDEST partition a
  token first. Inside a partition the survivors are re-ranked by Eqs. 5-9
  applied to the survivors, against the survivors of the next partition (the
  complete first window partition for the newest one). This keeps LagKV's
  uniform allocation over the whole history, as if r had been smaller, rather
  than forgetting old partitions wholesale. The shrink leaves room for the
  tokens until the next paper step (at most 2L), so compactions stay once per
  L tokens instead of once per token. N must hold the sinks and the window
  (N >= S + 2L - 1), which the budget rule checks (``budget_error``).
- a target below sinks + LagKV's window (only an explicit
  ``Session.compress(target)`` or a ratio-mode full cache can ask for one):
  once the compressed partitions are empty, the window gives up its oldest
  tokens (StreamingLLM), down to the ``window`` newest cells (a field,
  default 32); below sinks + ``window`` it is a BudgetError.

How ``select`` knows why it runs: the Session says so (``why``): "schedule"
when ``due`` asked for the compression, "budget" when its budget rule did (a
full cache), "call" for an explicit target.
A hint of when the next successor completes is the only state, and it does
not change which tokens are kept in budget mode; after a restore (ratio mode)
the stale hint can make the next paper step fire early (a select that keeps
everything) or up to 2L tokens late.

Defaults: S = 16 (the paper), r = 0.5 (the authors' code), L = 128: the
paper's smallest lag (it also runs 512 and 1024), because the L..2L-1 window
must fit the small budgets edgekv is for (the chat default is 1024 cells;
L = 1024 would need 2063). ``--param L=1024`` gives the paper's main setting.

NaN policy: the reference code divides by max - min with no guard. Here the
denominator is max(max - min, 1e-6) (a guard the paper's code lacks): a channel
that is constant over the reference contributes 0 for tokens equal to that
constant and a large value for tokens that deviate from it (the limit the
equation tends to), so scores stay finite. Non-finite K/V (never produced by
llama.cpp) rank lowest. Ties go to the earlier token.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import numpy as np
from numba import njit

from ..gguf_info import ModelInfo
from ..kvcache.snapshot import KVSnapshot
from .base import Method, Why, top_k

if TYPE_CHECKING:
    from ..config import BudgetRule

EPS = 1e-6
_CLASS = np.int64(1) << 50  # rank classes in the shrink key (protected > window > compressed)


def _softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; -inf entries get 0; an all -inf row gets all 0."""
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    tot = e.sum(axis=-1, keepdims=True)
    return np.where(tot > 0, e / np.where(tot > 0, tot, 1.0), 0.0)


@njit(cache=True)
def _channel_std(cur, mn, inv, ddof):  # pragma: no cover - compiled
    """std over channels of (cur - mn) * inv: cur [G, W, d], mn/inv [G, d] -> [G, W] (float64)."""
    n_g, n_w, d = cur.shape
    out = np.empty((n_g, n_w))
    z = np.empty(d)
    for g in range(n_g):
        for w in range(n_w):
            m = 0.0
            for c in range(d):
                z[c] = (cur[g, w, c] - mn[g, c]) * inv[g, c]
                m += z[c]
            m /= d
            v = 0.0
            for c in range(d):
                v += (z[c] - m) * (z[c] - m)
            out[g, w] = np.sqrt(v / (d - ddof))
    return out


@njit(cache=True)
def _member_scores(z, h, members, count, ref, n_ref, ddof):  # pragma: no cover - compiled
    """Eqs. 5-8 for one partition of one head: the softmax over its ``count`` members
    (cells ``members``) of their channel std, normalised by the per-channel min and max
    over the ``n_ref`` reference cells ``ref``; no reference: uniform. z [n, H, d].

    Laid out for SIMD without changing a bit of the result: the normalised members are
    held channel-major, so the loops run over channels outside and tokens inside; each
    token still adds its channels in order (the float64 sums of a per-token loop), but
    neighbouring tokens' sums are independent lanes."""
    d = z.shape[2]
    sd = np.zeros(count)
    lo = np.full(d, np.inf)
    hi = np.full(d, -np.inf)
    bad = np.zeros(d, dtype=np.bool_)
    for r in range(n_ref):
        row = z[ref[r], h]
        for c in range(d):
            val = np.float64(row[c])
            bad[c] |= val != val  # numpy's min and max propagate NaN: the channel scores NaN
            lo[c] = val if val < lo[c] else lo[c]
            hi[c] = val if val > hi[c] else hi[c]
    n_nan = 0
    inv = np.empty(d)
    for c in range(d):
        if bad[c]:
            lo[c] = np.nan
            n_nan += 1
        inv[c] = 1.0 / max(hi[c] - lo[c], EPS) if not bad[c] else np.nan
    if n_ref > 0 and n_nan < d:  # else no reference (or none usable): uniform
        x = np.empty((d, count))
        for i in range(count):
            row = z[members[i], h]
            for c in range(d):
                x[c, i] = (row[c] - lo[c]) * inv[c]
        m = np.zeros(count)
        for c in range(d):
            for i in range(count):
                m[i] += x[c, i]
        for i in range(count):
            m[i] /= d
        v = np.zeros(count)
        for c in range(d):
            for i in range(count):
                t = x[c, i] - m[i]
                v[i] += t * t
        for i in range(count):
            sd[i] = np.sqrt(v[i] / (d - ddof))
            if np.isnan(sd[i]):
                sd[i] = -np.inf  # only from non-finite K/V: rank lowest
    top = -np.inf
    for i in range(count):
        top = max(top, sd[i])
    if not np.isfinite(top):
        top = 0.0
    e = np.exp(sd - top)
    tot = e.sum()
    return e / tot if tot > 0 else np.zeros(count)


@njit(cache=True, nogil=True)
def group_scores(k, v, members):  # pragma: no cover - compiled
    """LagKV's scores, K plus V, of one layer's groups of cells, each group against the
    next: members [H, G + 1, W] (cells; a group ends at its first -1; group G is a
    reference only) -> float64 [H, G, W], padding -inf. The native engine's
    ``llama_edgekv_seq_lag_scores`` computes the same doubles in the cache's memory."""
    n_head, g1, width = members.shape
    ddof = 1 if k.shape[2] > 1 else 0
    ddof_v = 1 if v.shape[2] > 1 else 0
    out = np.full((n_head, g1 - 1, width), -np.inf)
    for h in range(n_head):
        for p in range(g1 - 1):
            count = 0
            while count < width and members[h, p, count] >= 0:
                count += 1
            if count == 0:
                continue
            ref = members[h, p + 1]
            n_ref = 0
            while n_ref < width and ref[n_ref] >= 0:
                n_ref += 1
            out[h, p, :count] = (_member_scores(k, h, members[h, p], count, ref, n_ref, ddof)
                                 + _member_scores(v, h, members[h, p], count, ref, n_ref, ddof_v))
    return out


def group_order(snap: KVSnapshot, members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The slots of every group's members from best to worst (ties to the earlier member) by
    LagKV's scores, each group against the next: members int [n_layer, n_kv_head, G + 1, W]
    (ordinals, -1 padding at the end of a group) -> (order int [n_layer, n_kv_head, G, w],
    padding last; scores float64, padding -inf), w <= W the widest scored group. Scored
    where the cache lives when the engine can (``KVSnapshot.lag_scores``), else from K and V
    here; both give the same doubles, so the same order."""
    s = snap.lag_scores(members) if "lag_scores" in snap.accelerators else None
    if s is None:
        s = np.empty(members.shape[:2] + (members.shape[2] - 1, members.shape[3]))

        def score_layer(layer: int) -> None:
            s[layer] = group_scores(snap.keys(layer), snap.values(layer), members[layer])

        _each_layer(snap, score_layer)
    # Only the first `w` slots of a scored group can hold members (the reference group,
    # which may be wider, is not ranked): sorting the padding beyond costs up to 10x more.
    used = np.flatnonzero((members[..., :-1, :] >= 0).any(axis=(0, 1, 2)))
    s = s[..., : int(used[-1]) + 1 if used.size else 1]
    return np.argsort(-s, axis=-1, kind="stable"), s  # padding (-inf) after every member


def group_ranks(snap: KVSnapshot, members: np.ndarray) -> np.ndarray:
    """Rank (0 = best) of every member of every group, as ``group_order`` orders them:
    int [n_layer, n_kv_head, G, w] (w as there), -1 padding."""
    order, s = group_order(snap, members)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(s.shape[-1]), axis=-1)
    return np.where(np.isneginf(s), -1, rank)


def _ref_range(ref: np.ndarray, mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Eqs. 5-6: per-channel min and max over the reference tokens (axis -2), float64.

    With a mask (padded groups), an empty reference gives (nan, nan): its
    group then scores uniformly."""
    if mask is None:
        return ref.min(axis=-2).astype(np.float64), ref.max(axis=-2).astype(np.float64)
    rm = mask[..., None]
    has = mask.any(axis=-1)[..., None]
    mn = np.where(has, np.where(rm, ref, np.inf).min(axis=-2), np.nan)
    mx = np.where(has, np.where(rm, ref, -np.inf).max(axis=-2), np.nan)
    return mn.astype(np.float64), mx.astype(np.float64)


def _scores(cur: np.ndarray, mn: np.ndarray, mx: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Eqs. 7-8: cur [..., W, d] normalised by mn/mx [..., d] -> softmax over W of the channel std."""
    empty = np.isnan(mn).all(axis=-1)  # no reference: uniform scores
    mn = np.where(empty[..., None], 0.0, mn)
    inv = 1.0 / np.maximum(np.where(empty[..., None], 1.0, mx - mn), EPS)  # NaN-safe: constant channels
    *lead, w, d = cur.shape
    sd = _channel_std(np.ascontiguousarray(cur.reshape(-1, w, d)), mn.reshape(-1, d),
                      inv.reshape(-1, d), 1 if d > 1 else 0).reshape(*lead, w)
    sd = np.where(empty[..., None], 0.0, sd)
    sd = np.where(np.isnan(sd), -np.inf, sd)  # only from non-finite K/V: rank lowest
    if mask is not None:
        sd = np.where(mask, sd, -np.inf)
    return _softmax(sd)


def lag_scores(cur: np.ndarray, ref: np.ndarray, cur_mask: np.ndarray | None = None,
               ref_mask: np.ndarray | None = None) -> np.ndarray:
    """Eqs. 5-8 for one stream (K or V): ``cur`` [..., W, d] against ``ref`` [..., Wr, d].

    Returns the softmax scores [..., W] in float64 (each row sums to 1 over
    its valid tokens). Masks mark the valid rows of padded groups; padding
    scores 0. A group whose reference is empty scores uniformly.
    """
    cur, ref = np.asarray(cur), np.asarray(ref)
    return _scores(cur, *_ref_range(ref, ref_mask), cur_mask)


def partition_scores(z: np.ndarray, L: int) -> np.ndarray:
    """Scores of consecutive partitions of one stream: ``z`` [P*L, H, d] -> [H, P-1, L].

    Partition p (rows pL..pL+L-1) is scored against partition p+1.
    """
    n, h, d = z.shape
    blocks = np.asarray(z).reshape(n // L, L, h, d).transpose(2, 0, 1, 3)  # [H, P, L, d]
    return lag_scores(blocks[:, :-1], blocks[:, 1:])


def retained_cells(n_tokens: int, sinks: int, L: int, k: int) -> int:
    """Eq. 10: cells LagKV holds after seeing n_tokens (k = tokens kept per partition)."""
    if n_tokens < sinks + 2 * L:
        return n_tokens
    u = n_tokens - sinks
    return sinks + k * (u // L - 1) + L + u % L


def _each_layer(snap: KVSnapshot, fn: Callable[[int], None]) -> None:
    """``fn(layer)`` for every layer, on all of the host's cores: the compression runs
    while llama.cpp's threads wait, and the scoring kernel releases the GIL. The K/V
    reads happen here first, one caller at a time (a native read is a device call); the
    workers put them in position order where the cells are not."""
    for layer in range(snap.n_layer):
        snap.prefetch(layer, values=True)  # K and V in one device read; fn orders them
    global _pool
    with _pool_lock:
        if _pool is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            _pool = ThreadPoolExecutor(max_workers=cores or 1, thread_name_prefix="edgekv-lagkv")
    for _ in _pool.map(fn, range(snap.n_layer)):  # re-raises a worker's exception
        pass


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


@cache
def _load_kernel() -> None:
    """Load the compiled scoring kernel when a session attaches the method, not inside
    its first compression: numba's first call in a process costs about half a second,
    once (a chat or a server pays it at start-up, an ingest would pay it mid-document)."""
    members = np.zeros((2, 2, 2), np.int64)
    z = np.zeros((2, 2, 2), np.float32)
    group_scores(z, z, members)  # C-contiguous: the state engine
    a = z.transpose(1, 0, 2)  # [n, H, d] viewed from [H, n, d]: the native engine's reads
    group_scores(a, a, members)


def _intact_start(tp: np.ndarray, T: int) -> int:
    """Smallest position P such that every head holds every token in [P, T)."""
    n = tp.shape[-1]
    s = (tp - np.arange(n) == T - n).sum(axis=-1)  # length of each head's intact suffix
    return T - int(s.min())


@dataclass
class LagKV(Method):
    """LagKV (lag-relative information): each partition of L tokens is scored
    against the next one, per (layer, KV head), from K and V alone; the top
    r*L tokens per partition are kept. Sinks + the last L..2L-1 tokens stay."""

    name = "lagkv"
    summary = "lag-relative K/V statistics, per-partition top r*L (LagKV 2025); incremental"

    sinks: int = 16
    window: int = 32  # newest cells a too-small target can never take (LagKV's own window is L..2L-1)
    L: int = 128
    r: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.L, int) or self.L < 1:
            raise ValueError(f"L (partition length) must be a positive integer, got {self.L!r}")
        if not 0.0 <= float(self.r) <= 1.0:
            raise ValueError(f"r (fraction kept per partition) must be in [0, 1], got {self.r!r}")
        if self.sinks < 0 or self.window < 0:
            raise ValueError("sinks and window must be >= 0")
        # Set by bind and select; never needed for correctness (see the module docstring).
        self._budget: int | None = None
        self._r: float | None = None
        self._due_in = 0  # tokens until the next partition's successor completes

    def attach(self, info: ModelInfo) -> None:
        _load_kernel()

    # -- budget rule -----------------------------------------------------------
    @property
    def keep_per_partition(self) -> int:
        """k = floor(r * L), r from --ratio (r = 1 - R) when the session gave one."""
        r = self.r if self._r is None else self._r
        return min(self.L, max(0, math.floor(r * self.L + 1e-9)))

    def bind(self, rule: BudgetRule) -> None:
        self._budget = rule.budget
        self._r = None if rule.ratio is None else 1.0 - rule.ratio
        self._due_in = 0

    def budget_error(self, budget: int) -> str | None:
        need = self.sinks + 2 * self.L - 1  # the sinks and a window of L..2L-1 tokens
        return super().budget_error(budget) or (
            f"--budget {budget} cannot hold lagkv's {self.sinks} sinks + window of up to "
            f"{2 * self.L - 1} tokens (L={self.L}): use --budget >= {need} or a smaller L (--param L=...)"
            if budget < need else None)

    def due(self, tokens_since_compress: int, n_cells: int) -> bool:
        if self._budget is not None:
            fire = n_cells > self._budget
        elif self.keep_per_partition >= self.L:
            fire = False  # r = 1: the paper step never removes anything
        else:
            # Two complete partitions after the sinks is necessary; _due_in (from
            # the last selection) says when the next successor completes.
            fire = n_cells >= self.sinks + 2 * self.L and tokens_since_compress >= self._due_in
        return fire

    # -- selection -------------------------------------------------------------
    def step(self, snap: KVSnapshot) -> np.ndarray:
        """The paper's incremental step alone: compress every uncompressed
        partition whose successor is complete. int [L, H, B], ascending."""
        tp = snap.token_pos.astype(np.int64)
        return self._step(snap, tp, int(tp[..., -1].max()) + 1)[0]

    def _frontier(self, tp: np.ndarray, T: int) -> int:
        """Index of the first uncompressed partition (clipped to the complete ones)."""
        n_full = max(0, (T - self.sinks) // self.L)
        start = _intact_start(tp, T) - self.sinks
        return min(n_full, max(0, -(-start // self.L)))

    def _step(self, snap: KVSnapshot, tp: np.ndarray, T: int) -> tuple[np.ndarray, int]:
        n_layer, n_head, n = tp.shape
        S, L, k = self.sinks, self.L, self.keep_per_partition
        n_full = max(0, (T - S) // L)
        f = self._frontier(tp, T)
        q = n_full - 1 - f  # partitions to compress now, each against its successor
        if q <= 0:
            return np.broadcast_to(np.arange(n), (n_layer, n_head, n)).copy(), f
        c0 = n - (T - (S + f * L))  # cell of position S + fL (same in every head: intact tail)
        # partition p holds cells c0 + pL .. c0 + pL + L - 1 in every head; the last is scored
        # against partition q, the first uncompressed one
        cells = c0 + np.arange((q + 1) * L, dtype=np.int64).reshape(q + 1, L)
        order, _ = group_order(snap, np.ascontiguousarray(np.broadcast_to(cells, (n_layer, n_head, q + 1, L))))
        # the top k of each partition (ties: the earlier token), in token order
        sel = np.sort(order[..., :k], axis=-1) + cells[:q, :1]
        head = np.broadcast_to(np.arange(c0), (n_layer, n_head, c0))
        tail = np.broadcast_to(np.arange(c0 + q * L, n), (n_layer, n_head, n - c0 - q * L))
        return np.concatenate([head, sel.reshape(n_layer, n_head, q * k), tail], axis=2), f + q

    def _survivor_ranks(self, snap: KVSnapshot, keep: np.ndarray, tp: np.ndarray, f: int, T: int) -> np.ndarray:
        """Rank (0 = best) of each surviving token of compressed partitions 0..f-1
        inside its partition, by Eqs. 5-9 applied to the survivors against the
        survivors of the next partition (for partition f-1: the intact window
        partition f, its original reference). int [L, H, n]; -1 elsewhere."""
        n_layer, n_head, n = tp.shape
        S, L = self.sinks, self.L
        g = np.where((tp >= S) & (tp < S + f * L), (tp - S) // L, -1)
        j = np.arange(n)
        start = np.ones_like(g, dtype=bool)
        start[..., 1:] = g[..., 1:] != g[..., :-1]
        pos_in = j - np.maximum.accumulate(np.where(start, j, 0), axis=-1)
        width = int(pos_in[g >= 0].max()) + 1
        # Partition f lies in the intact tail: the same cells in every head.
        p0 = S + f * L
        last = slice(n - (T - p0), n - (T - min(T, p0 + L)))
        ref = keep[:, :1, last]  # [n_layer, 1, <= L]
        members = np.full((n_layer, n_head, f + 1, max(width, ref.shape[2])), -1, dtype=np.int64)
        ll, hh, jj = np.nonzero(g >= 0)  # cells of each partition, in order
        gi, pi = g[ll, hh, jj], pos_in[ll, hh, jj]
        members[ll, hh, gi, pi] = keep[ll, hh, jj]
        members[:, :, f, : ref.shape[2]] = ref
        rho = np.full(tp.shape, -1, dtype=np.int64)
        rho[ll, hh, jj] = group_ranks(snap, members)[ll, hh, gi, pi]
        return rho

    def _shrink(self, snap: KVSnapshot, keep: np.ndarray, tp: np.ndarray, f: int, T: int,
                goal: int) -> np.ndarray:
        """Bring [L, H, n] kept cells down to ``goal`` per head (module docstring)."""
        n = keep.shape[2]
        S, L = self.sinks, self.L
        j = np.arange(n)
        prot = (tp < S) | (j >= n - max(self.window, 1))
        self.refuse_below(goal, int(prot.sum(axis=-1).max()))
        bound = S + f * L
        comp = (tp >= S) & (tp < bound)
        key = np.where(prot, 3 * _CLASS, np.where(tp >= bound, 2 * _CLASS + tp, 0))
        if f and comp.any():
            rho = self._survivor_ranks(snap, keep, tp, f, T)
            # Water-filling as one sort: rank level first, then the newer partition.
            key = np.where(comp & ~prot, _CLASS - rho * (f + 1) + (tp - S) // L, key)
        top = top_k(key.reshape(-1, n), goal).reshape(*key.shape[:2], goal)
        return np.take_along_axis(keep, top, axis=-1)

    def select(self, snap: KVSnapshot, budget: int, *, why: Why = "call") -> np.ndarray:
        n = snap.n_cells
        if budget >= n:
            return np.broadcast_to(np.arange(n), (snap.n_layer, snap.n_kv_head, n)).copy()
        tp = snap.token_pos.astype(np.int64)
        T = int(tp[..., -1].max()) + 1
        keep, f = self._step(snap, tp, T)
        n1 = keep.shape[2]
        # A compression LagKV scheduled itself (ratio mode) is the paper step only;
        # otherwise (budget mode, full cache, explicit target) the target holds.
        enforce = self._budget is not None or why != "schedule"
        if enforce:
            tp1 = np.take_along_axis(tp, keep, axis=-1)
            goal = budget
            if self._budget is not None and why != "call":
                # Budget mode: also make room for the tokens until the next paper
                # step, from the compressed partitions only (never the window).
                # The cache would reach the budget before then anyway, and the
                # survivors' ranks do not change in between, so these are the
                # tokens later shrinks would take: same cache, one compaction
                # per L tokens instead of one per token.
                window = T - (self.sinks + f * self.L)
                floor = n1 - int(((tp1 >= self.sinks) & (tp1 < self.sinks + f * self.L)).sum(-1).min())
                goal = max(budget - (2 * self.L - window), min(budget, floor))
            if n1 > goal:
                keep = self._shrink(snap, keep, tp1, f, T, goal)
        tp_new = np.take_along_axis(tp, keep, axis=-1)
        self._due_in = self.sinks + (self._frontier(tp_new, T) + 2) * self.L - T
        return keep
