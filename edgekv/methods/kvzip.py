"""KVzip ("KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
Kim et al. 2025, arXiv:2505.23416; notes in docs/methods.md).

A cached token matters if the model needs it to reproduce the context. Before
compressing, the model is asked to repeat what the cache holds, teacher-forced
with that very text, chunk by chunk: "Repeat the previous context exactly." (or,
after the first chunk, "Repeat the part of the previous context exactly,
starting with" and the previous chunk's last 8 tokens), the chat template's
user-turn suffix, then the chunk. Every query of that pass attends to the whole
cache as usual; KVzip's score is a second softmax over only the first ``sinks``
tokens, the chunk being repeated and the repeat tokens themselves (causally), and
each cell of the chunk scores the largest share any repeat query of its KV head's
group gives it. Sinks are kept.

In edgekv the repeat pass runs on the session's own context and is rolled back
with ``save``/``restore``: the cache being compressed never keeps a repeat token.
Its cells come from ``scratch_cells`` (the reconstruction chunk plus the
prompts) that the Session allocates beside the capacity for a method that asks:
so the KV memory is ``capacity + scratch_cells`` cells, and the reconstruction
chunk (``chunk``, 256 by default against kvpress's 2048) is what that costs.
Selection is per (layer, KV head) top-k, edgekv's uniform cell count; kvpress
ranks across heads and layers (masked, nothing freed) unless ``layerwise``.
Each compression costs a forward pass over as many tokens as the cache has cells
(``span``), plus the prompts: the price of knowing what to keep before the
question comes. After per-head compactions the heads hold different tokens, and
the pass repeats those the most heads hold (``to_repeat``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import EdgekvError
from ..kvcache.snapshot import KVSnapshot
from .base import ScorerMethod, Why

if TYPE_CHECKING:
    from ..kvcache.engine import KVEngine

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
PREVIOUS_TAIL = 8  # tokens of the previous chunk that start the next prompt
PROMPT_ROOM = 48  # scratch cells beyond the chunk: the longer prompt, the tail and a template suffix


def reconstruction_scores(q: np.ndarray, q_pos: np.ndarray, k: np.ndarray, cell_pos: np.ndarray,
                          token_pos: np.ndarray, first_repeat: int, sinks: int, lo: int, hi: int,
                          kq_scale: float) -> np.ndarray:
    """float64 [n_kv_head, n]: KVzip's score of each cell for one layer and one chunk.

    ``q`` [n_head, m, d]: the repeat pass's post-RoPE queries at llama positions ``q_pos``;
    ``k`` [n, n_kv_head, d]: every cell's key (the context and the repeat tokens), in
    position order, at llama positions ``cell_pos`` [n]; ``token_pos`` [n_kv_head, n]: the
    token each (head, cell) holds. A cell is a repeat cell when ``cell_pos >= first_repeat``.
    Per query, the softmax of ``kq_scale * q.k`` runs over the head's sinks (token
    positions < ``sinks``), its chunk cells (token positions in [lo, hi)) and the repeat
    cells at or before the query; a chunk cell scores the maximum over the queries and the
    query heads of its group. Cells outside the chunk score 0."""
    n_head, m, d = q.shape
    n, n_kv, _ = k.shape
    group = n_head // n_kv
    repeat = cell_pos >= first_repeat
    out = np.zeros((n_kv, n))
    for h in range(n_kv):
        tp = token_pos[h]
        chunk = ~repeat & (tp >= lo) & (tp < hi)
        if not chunk.any():
            continue
        cols = np.flatnonzero(~repeat & (tp < sinks) | chunk | repeat)
        qg = q[h * group:(h + 1) * group].reshape(group * m, d).astype(np.float64)
        logits = kq_scale * (qg @ k[cols, h].astype(np.float64).T)  # [group * m, c]
        later = repeat[cols][None, :] & (cell_pos[cols][None, :] > np.tile(q_pos, group)[:, None])
        logits[later] = -np.inf
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        in_chunk = chunk[cols]
        out[h, cols[in_chunk]] = p[:, in_chunk].max(axis=0)
    return out


@dataclass
class KVzip(ScorerMethod):
    """Keep the cells the model needs to repeat the context, per (layer, KV head)."""

    name = "kvzip"
    summary = "keep what the model attends to while repeating the context (Kim et al. 2025)"
    needs = frozenset({"queries"})

    sinks: int = 4
    window: int = 0  # KVzip scores every token; the newest cell is kept regardless
    chunk: int = 256  # context tokens repeated per pass (kvpress: 2048)
    span: float = 1.0  # most tokens repeated per compression, as a multiple of the cells held

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk < PREVIOUS_TAIL + 1:
            raise ValueError(f"chunk must be more than {PREVIOUS_TAIL} tokens, got {self.chunk}")
        if not self.span > 0:
            raise ValueError(f"span must be positive, got {self.span}")

    @property
    def scratch_cells(self) -> int:
        return self.chunk + PROMPT_ROOM

    def score(self, snap: KVSnapshot, layer: int) -> np.ndarray:
        if snap.reconstruction is None:
            raise EdgekvError("kvzip scores come from a reconstruction pass over the cache: compress through "
                              "a session or an engine (KVzip.compress), not a bare snapshot")
        return snap.reconstruction[layer]

    def compress(self, engine: KVEngine, target: int, *, why: Why = "call") -> int:
        if target >= engine.n_cells:
            return 0  # nothing to evict: no reconstruction pass
        return super().compress(engine, target, why=why)

    def snapshot(self, engine: KVEngine) -> KVSnapshot:
        scores, token_pos = self.reconstruct(engine)
        snap = engine.snapshot()
        if not np.array_equal(snap.token_pos, token_pos):
            raise EdgekvError("kvzip: the cache changed under its reconstruction pass")
        snap.reconstruction = scores
        return snap

    def reconstruct(self, engine: KVEngine) -> tuple[np.ndarray, np.ndarray]:
        """KVzip's scores [rows, n_kv_head, n] of the engine's cells (position order), and the
        token map they belong to. The cache is as it was afterwards."""
        ctx = engine.ctx
        model = ctx.model
        snap = engine.snapshot()
        n = snap.n_cells
        token_pos = snap.token_pos.copy()
        held = self.to_repeat(token_pos)
        ids = engine.tokens.token_ids(held)
        if (ids < 0).any():
            raise EdgekvError("kvzip needs the text the cache holds, and this cache's token ids are unknown "
                              "(it was restored from a session file without them)")
        suffix = self._suffix(model)
        first_repeat = int(snap.pos.max()) + 1 if n else 0
        room = ctx.n_ctx - n
        prompts = [model.tokenize(FIRST_PROMPT, add_special=False, parse_special=False),
                   model.tokenize(NEXT_PROMPT, add_special=False, parse_special=False)]
        size = min(self.chunk, room - max(len(p) for p in prompts) - PREVIOUS_TAIL - len(suffix))
        if size < PREVIOUS_TAIL + 1:
            raise EdgekvError(f"kvzip needs about {self.scratch_cells} free cells beside the {n} it compresses "
                              f"to repeat the context, and the context has {room} (use kvzip from the session's "
                              "start, which allocates them, or a smaller --param chunk=...)")
        window = engine.window.size if engine.window is not None else 0
        tally = engine.tally is not None
        saved = engine.save()
        scores = np.zeros(token_pos.shape, np.float64)
        try:
            starts = range(0, held.shape[0], size)
            for i, s0 in enumerate(starts):
                if i:
                    engine.restore(saved)  # the previous chunk's repeat tokens out
                part = ids[s0 : s0 + size]
                head = prompts[0] if i == 0 else prompts[1] + ids[max(0, s0 - PREVIOUS_TAIL) : s0].tolist()
                rep = head + suffix + part.tolist()
                engine.observe(len(rep), tally=False)
                for b0 in range(0, len(rep), ctx.n_batch):
                    engine.decode(rep[b0 : b0 + ctx.n_batch], first_repeat + b0)
                q, q_pos = engine.window.last(len(rep))
                full = engine.snapshot()
                lo, hi = int(held[s0]), int(held[min(s0 + size, held.shape[0]) - 1]) + 1
                for row in range(full.n_layer):
                    got = reconstruction_scores(q[row], q_pos, full.keys(row), full.pos, full.token_pos[row],
                                                first_repeat, self.sinks, lo, hi, full.kq_scale)
                    scores[row] = np.maximum(scores[row], got[:, :n])
        finally:  # the window back to its size first, so the restore refills it whole
            engine.observe(window, tally=tally)
            engine.restore(saved)
        scores[token_pos < self.sinks] = 1.0
        return scores, token_pos

    def to_repeat(self, token_pos: np.ndarray) -> np.ndarray:
        """The token positions to repeat, ascending: those the most (layer, KV head)s hold, at
        most ``span`` times the cells held, the sinks always.

        After per-head compactions every head keeps other tokens, and the union of what they
        hold grows towards the whole history; repeating all of it would make each compression
        cost a pass over everything seen so far. A token outside the repeat scores 0 in the
        heads that still hold it: the cache as a whole had already let it go."""
        held, holders = np.unique(token_pos, return_counts=True)
        most = max(1, int(np.ceil(self.span * token_pos.shape[-1])))
        if held.shape[0] <= most:
            return held
        rank = np.lexsort((-held, -holders))  # most holders first, then the newest
        chosen = np.zeros(held.shape[0], bool)
        chosen[rank[:most]] = True
        chosen |= held < self.sinks
        return held[chosen]

    @staticmethod
    def _suffix(model: object) -> list[int]:
        """The chat template's user-turn suffix (what follows a user message up to the
        assistant's turn), as kvpress reuses it; a newline without a template."""
        marker = "\n" + "#" * 13
        text = model.apply_chat_template([{"role": "user", "content": "dummy context" + marker}])
        if marker not in text or text.startswith("user:"):  # no template: edgekv's plain transcript
            return model.tokenize("\n", add_special=False, parse_special=False)
        return model.tokenize(text.split(marker, 1)[1], add_special=False, parse_special=True)
