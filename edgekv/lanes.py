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
stream: the portable state engine. The tensor capture records a batch's
queries row by row, and each lane takes its own rows, so the attention methods
run on lanes too. What does not: H2O's tally (the capture sums the softmax
over a whole batch, every lane's queries together), the log-count bias of
``chelsea`` (one tensor per layer for a context of one sequence), KVzip's
repeat pass (scratch cells beside the sequence) and edgekv's native ops (a
context of one sequence). ``Lanes.refusal`` says which and why; the server
gives those conversations a context of their own.
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
        n_batch = n_batch or options.chunk
        arch = model.arch
        # iSWA models (Gemma 3): a stream's sliding-window cache must hold a window plus a batch
        per = max(cells, arch.n_swa + n_batch) if arch.n_swa else cells
        self.ctx = Context(model, n_ctx=per * n_lanes, n_seq_max=n_lanes, n_batch=n_batch,
                           cache_type_k=options.cache_type_k, cache_type_v=options.cache_type_v,
                           flash_attn=options.flash_attn, n_threads=options.n_threads)
        self.cells = self.ctx.n_ctx_seq
        if self.cells < cells:
            self.ctx.close()
            raise EdgekvError(f"lanes: llama.cpp gave each of {n_lanes} sequences {self.cells} cells, "
                              f"fewer than the {cells} asked")
        self.n_lanes = n_lanes
        self._free = list(range(n_lanes - 1, -1, -1))
        self._queue: dict[int, tuple[Session, int, int]] = {}  # seq -> (session, token, position)
        self.steps = 0  # flushes of the queue so far
        self.decodes = 0  # llama_decode calls they made (one per run of consecutive lanes)
        self.tokens = 0  # tokens they decoded

    @staticmethod
    def refusal(method: Method) -> str | None:
        """Why a lane cannot run ``method``, or None when it can (the state engine's own
        limits, such as a build without the tensor capture, are the Session's to say)."""
        if "bias" in method.needs:
            return ("its merged cells need the log-count bias, one tensor per layer for a context of one "
                    "sequence")
        if method.tallies:
            return "its tally sums llama.cpp's softmax over a whole batch, every lane's queries together"
        if method.scratch_cells:
            return f"its own passes need {method.scratch_cells} scratch cells beside the sequence"
        return None

    def accepts(self, method: Method) -> bool:
        """Whether a session on these lanes can run ``method``."""
        if self.refusal(method) is not None:
            return False
        return "queries" not in method.needs or self.ctx.capture is not None

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
        """Decode every queued token and hand each session its logits and queries.

        llama.cpp evaluates a batch of several streams as one ubatch only while their
        sequence ids are consecutive (its ``split_equal`` for a non-unified cache), and the
        tensor capture keeps a decode's last ubatch. So each run of consecutive lanes is one
        ``llama_decode``: all of them when every lane generates. What goes wrong goes to the
        session it concerns, which raises it at its next call (``Session.settle``): a failed
        decode to every session of that run and the later ones (nothing of theirs is in the
        cache), a failed recording of queries to that lane alone."""
        if not self._queue:
            return
        items = sorted(self._queue.items())
        self._queue.clear()
        runs: list[list[tuple[int, tuple[Session, int, int]]]] = []
        for item in items:
            if runs and item[0] == runs[-1][-1][0] + 1 and len(runs[-1]) < self.ctx.n_batch:
                runs[-1].append(item)
            else:
                runs.append([item])
        self.steps += 1
        for k, run in enumerate(runs):
            try:
                self.ctx.decode_each([(tok, pos, seq) for seq, (_, tok, pos) in run])
            except EdgekvError as e:
                for later in runs[k:]:
                    for _, (sess, _tok, _pos) in later:
                        sess._lane_failed(e)
                return
            self.decodes += 1
            self.tokens += len(run)
            for i, (_, (sess, tok, pos)) in enumerate(run):
                try:
                    sess._lane_decoded(tok, pos, self.ctx.logits(i), i, len(run))
                except EdgekvError as e:
                    sess._lane_failed(e)

    def unqueue(self, seq: int) -> None:
        """Forget a token ``seq`` queued (its conversation is dropped, its cache emptied next)."""
        self._queue.pop(seq, None)

    def close(self) -> None:
        self._queue.clear()
        self.ctx.close()


__all__ = ["Lanes"]
