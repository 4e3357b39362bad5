"""The KV engine protocol: the few verbs edgekv needs from a llama.cpp KV cache.

In the spirit of mlx-lm's cache objects:

- ``snapshot()``: the sequence's keys/values as float32, in position order,
  with the original token each (layer, KV head, cell) holds (``snapshot.py``);
- ``compact(keep)``: keep, per (layer, KV head), the given cells (same count
  B for all), gathered into cells 0..B-1; everything else is freed;
- ``save()`` / ``restore(state)``: the whole sequence, to branch or reuse a prefill;
- ``n_cells``: cells held now.

Two implementations: ``StateEngine`` (``state.py``; any stock libllama, through the
per-sequence state API) and ``NativeEngine`` (``native.py``; the ggml patch set, same
verbs, done where the cache lives). Both must leave identical caches. The bookkeeping
they share (token map, keep and merge checks) is in ``cells.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .queries import AttentionTally, QueryMoments, QueryWindow
from .snapshot import KVSnapshot


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
    ids: np.ndarray | None = None  # int32 token id per token position, -1 unknown (TokenMap.ids)
    moments: QueryMoments | None = None  # pre-RoPE query statistics, when the engine keeps them

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
    moments: QueryMoments | None  # pre-RoPE query statistics, while ``observe(..., moments=True)`` keeps them

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

    def observe(self, size: int, *, tally: bool = False, moments: bool = False) -> None: ...

    def merge(self, src: np.ndarray, dst: np.ndarray, *, bias: bool) -> None: ...
