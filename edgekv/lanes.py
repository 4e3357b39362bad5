"""Several sessions in one llama.cpp context, their generated tokens decoded together.

A context made with ``n_seq_max = K`` and llama.cpp's non-unified cache holds K
sequences, each in a KV stream of its own: n_ctx / K cells, attention over its
own stream only. One ``llama_decode`` then advances every sequence by a token
and reads the weights once for all of them, where K contexts read them K times
(``bench/server_modes.py``: 1.18 times the tokens per second at 4
conversations, f16, this CPU).

Each ``Session`` made with ``lanes=`` takes one of the K sequences (a lane).
Its prompts decode at once, as in a context of its own. A token it generates is
queued instead (``Session.step``), and the queue is decoded in one batch when
any lane next needs its cache: so a driver that steps every conversation once,
round-robin (the server's worker), decodes them together without knowing it.
Each lane keeps a copy of its own logits, since the shared output buffer holds
only the last decode's rows.

What a lane runs on is llama.cpp's per-sequence state API, which works per
stream: the portable state engine. edgekv's native ops, the log-count bias and
the tensor capture act on a whole single-stream context, so methods that need
them (the query capture: snapkv, chunkkv, h2o, compresskv, protokv,
expected_attention, kvzip; the bias: chelsea) are refused on a lane with their
one-line error and run in a context of their own (the server does that).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import ContextOptions
from .errors import EdgekvError
from .llama import Context, Model

if TYPE_CHECKING:
    from .methods import Method
    from .session import Session


class Lanes:
    """One context of ``n_lanes`` sequences of ``cells`` cells each, and the queue of tokens
    its sessions generated and have not decoded yet."""

    def __init__(self, model: Model, n_lanes: int, cells: int, options: ContextOptions | None = None,
                 n_batch: int | None = None) -> None:
        if n_lanes < 1:
            raise EdgekvError(f"lanes: at least one sequence, got {n_lanes}")
        options = options or ContextOptions()
        self.model = model
        self.options = options
        # no tensor capture: its records would mix the lanes' queries (see the module's docstring)
        self.ctx = Context(model, n_ctx=cells * n_lanes, n_seq_max=n_lanes, n_batch=n_batch or options.chunk,
                           cache_type_k=options.cache_type_k, cache_type_v=options.cache_type_v,
                           flash_attn=options.flash_attn, n_threads=options.n_threads, capture=False)
        self.cells = self.ctx.n_ctx_seq
        if self.cells < cells:
            self.ctx.close()
            raise EdgekvError(f"lanes: llama.cpp gave each of {n_lanes} sequences {self.cells} cells, "
                              f"fewer than the {cells} asked")
        self.n_lanes = n_lanes
        self._free = list(range(n_lanes - 1, -1, -1))
        self._queue: dict[int, tuple[Session, int, int]] = {}  # seq -> (session, token, position)
        self.steps = 0  # batched decodes so far
        self.tokens = 0  # tokens they decoded

    @staticmethod
    def accepts(method: Method) -> bool:
        """Whether a lane runs ``method``: the state engine without the tensor capture merges
        (numpy over the state blob) but records no queries, and has no scratch cells."""
        return method.needs <= {"merge"} and method.scratch_cells == 0

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """A free sequence for a new session."""
        if not self._free:
            raise EdgekvError(f"all {self.n_lanes} lanes of this context are taken")
        return self._free.pop()

    def give_back(self, seq: int) -> None:
        """A session is done with ``seq``: its cells are freed for the next one."""
        self._queue.pop(seq, None)
        self.ctx.seq_rm(seq, -1, -1)
        self._free.append(seq)

    def queue(self, sess: Session, seq: int, token: int, pos: int) -> None:
        """Decode ``token`` at ``pos`` into ``seq`` with the next batch."""
        if seq in self._queue:
            raise EdgekvError(f"lane {seq} already has a token waiting to be decoded")
        self._queue[seq] = (sess, token, pos)

    def waiting(self, seq: int) -> bool:
        return seq in self._queue

    def flush(self) -> None:
        """Decode every queued token in one ``llama_decode`` and hand each session its logits.
        If the decode fails, every queued session is told so, and nothing is in its cache."""
        if not self._queue:
            return
        items = sorted(self._queue.items())
        self._queue.clear()
        try:
            self.ctx.decode_each([(tok, pos, seq) for seq, (_, tok, pos) in items])
        except EdgekvError as e:
            for _, (sess, _tok, _pos) in items:
                sess._lane_failed(e)
            raise
        self.steps += 1
        self.tokens += len(items)
        for i, (_, (sess, tok, pos)) in enumerate(items):
            sess._lane_decoded(tok, pos, self.ctx.logits(i))

    def close(self) -> None:
        self._queue.clear()
        self.ctx.close()


__all__ = ["Lanes"]
