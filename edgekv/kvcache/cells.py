"""Cell bookkeeping shared by both engines: which token each (layer, KV head, cell)
holds, and the checks and arithmetic of compactions and merges.

llama.cpp keeps one position per cell; after a per-head compaction a cell holds a
different token in every head, so edgekv keeps that map itself (``TokenMap``). The
checks here are the contract every method and engine relies on; the merge helpers
compute what the native merge op computes, so both engines write the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import EdgekvError


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
    # the token id at each token position decoded, -1 where unknown: what the cache's cells
    # stand for as text (KVzip feeds the context back to the model); compactions keep it whole
    ids: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.ids = np.full(0, -1, dtype=np.int32)
        self.token_pos = np.zeros((0, self.n_kv_head, 0), dtype=np.int32)
        self.counts = None
        self.rot = None
        self.n_cells = 0
        self.pos_shift = 0

    def record(self, first: int, tokens: list[int]) -> None:
        """Tokens decoded at token positions first, first + 1, ... (``ids``)."""
        end = first + len(tokens)
        if end > self.ids.shape[0]:
            grown = np.full(max(end, 2 * self.ids.shape[0], 256), -1, dtype=np.int32)
            grown[: self.ids.shape[0]] = self.ids
            self.ids = grown
        self.ids[first:end] = tokens

    def token_ids(self, positions: np.ndarray) -> np.ndarray:
        """int32 ids at these token positions, -1 where none was recorded."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.full(positions.shape, -1, dtype=np.int32)
        inside = (positions >= 0) & (positions < self.ids.shape[0])
        out[inside] = self.ids[positions[inside]]
        return out

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
    """A merge of every (layer, head) as groups, binned by width: int64 [n_layer, n_kv_head,
    G, M] arrays, M a power of two (so that one large group does not pad every other),
    ascending. Each row is a destination followed by its sources in ascending order, padded
    with -1; a (layer, head) with fewer than G groups of a width fills its last rows with
    its first source alone (``[src[l, h, 0], -1, ...]``, which averages to that cell's own
    row: drop such rows where only real groups are wanted, ``g[:, 1] >= 0``)."""
    L, H, m = src.shape
    lh = np.repeat(np.arange(L * H), m)
    s, d = src.reshape(-1), dst.reshape(-1)
    order = np.lexsort((s, d, lh))
    lh, d, s = lh[order], d[order], s[order]
    starts = np.flatnonzero(np.r_[True, (d[1:] != d[:-1]) | (lh[1:] != lh[:-1])])
    sizes = np.diff(np.r_[starts, d.size]) + 1  # the destination and its sources
    width = 1 << np.ceil(np.log2(sizes)).astype(int)
    group = np.repeat(np.arange(starts.size), sizes - 1)  # of each source, in sorted order
    column = np.arange(d.size) - starts[group] + 1  # its place in the group's row
    out = []
    for w in np.unique(width):
        idx = np.flatnonzero(width == w)  # this width's groups, by (layer, head), then destination
        at = lh[starts[idx]]
        count = np.bincount(at, minlength=L * H)
        row = np.empty(starts.size, np.int64)
        row[idx] = np.arange(idx.size) - np.r_[0, np.cumsum(count)[:-1]][at]  # its row in its (layer, head)
        g = -np.ones((L * H, int(count.max()), int(w)), np.int64)
        g[:, :, 0] = src[:, :, 0].reshape(-1, 1)
        g[at, row[idx], 0] = d[starts[idx]]
        mine = width[group] == w
        g[lh[mine], row[group[mine]], column[mine]] = s[mine]
        out.append(g.reshape(L, H, *g.shape[1:]))
    return out
