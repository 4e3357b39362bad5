"""A sequence whose KV cache never outgrows its context.

``Session`` drives llama.cpp's low-level API: prompts are decoded in chunks,
and whenever the next chunk would not fit in ``n_ctx`` cells the cache is
compressed by the configured method, through the engine, and decoding goes
on. So a prompt far longer than ``n_ctx`` is processed in bounded KV memory,
and a chat never runs out of context.

The budget rule (``budget``, ``ratio``, and what each means) and the context
options live in ``config.py``; a Session is given both, or makes them once from
its keywords.
"""

from __future__ import annotations

import codecs
import dataclasses
import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .config import DEFAULT_CHUNK, BudgetRule, ContextOptions
from .errors import BudgetError, EdgekvError
from .gguf_info import kv_bytes_per_token
from .kvcache import CacheState, KVEngine, StateEngine, make_engine
from .kvcache.files import load_cache_file, save_cache_file
from .lanes import Lanes
from .llama import Context, Model, Sampler, SamplerConfig
from .methods import Method
from .methods.base import Why

ProgressFn = Callable[[int, int], None]


class Event(NamedTuple):
    """One compression: tokens seen when it ran, cells before and after."""

    tokens_seen: int
    before: int
    after: int


CompressFn = Callable[[Event], None]


@dataclass
class Reply:
    """How a stream ended: ``finish`` "stop" (end of generation or a stop string) or
    "length" (``max_tokens``, or a full cache), the tokens generated, the text sent."""

    finish: str = "length"
    tokens: int = 0
    text: str = ""


def _hold_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could begin a stop string (not sent yet)."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    return n


@dataclass
class Stats:
    """Counters a user (or a test) can read at any time."""

    capacity: int  # cells the session may hold (its --n-ctx)
    kv_bytes_per_cell: int
    scratch_cells: int = 0  # allocated beside the capacity for the method's own passes (KVzip)
    cells: int = 0
    peak_cells: int = 0
    compressions: int = 0
    tokens_seen: int = 0
    tokens_evicted: int = 0
    compress_seconds: float = 0.0
    events: list[Event] = field(default_factory=list)

    @property
    def kv_bytes(self) -> int:
        return self.cells * self.kv_bytes_per_cell

    @property
    def kv_bytes_allocated(self) -> int:
        return (self.capacity + self.scratch_cells) * self.kv_bytes_per_cell

    @property
    def kept_fraction(self) -> float:
        return self.cells / self.tokens_seen if self.tokens_seen else 1.0

    def as_dict(self) -> dict[str, object]:
        """The counters as JSON-ready values (``--stats-json``, the server's saved index),
        with ``kv_bytes``; ``from_dict`` reads them back."""
        return {**dataclasses.asdict(self), "events": [list(e) for e in self.events], "kv_bytes": self.kv_bytes}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Stats:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known and k != "events"},
                   events=[Event(*e) for e in d.get("events", [])])


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a compression runs (and on again after,
    if it was on). Its full passes walk every object in the process, numba's and numpy's
    included, holding the GIL that the scoring threads take in turn: perf put it at 3 % of
    a ProtoKV compression's CPU, and pausing it took 0.943 of the wall time (16 rounds,
    interleaved). A compression makes few reference cycles; they are collected after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Session:
    """One sequence on one model, with bounded-memory decoding.

    Not thread-safe: one thread at a time may call a Session. Several sessions
    may share one ``Model`` (llama.cpp only reads the weights), each with its own
    context; calls into different sessions from different threads are safe but
    compete for the same cores.
    """

    def __init__(
        self,
        model: Model | str | Path | object,
        *,
        method: str | Method = "full",
        budget: int | None = None,
        ratio: float | None = None,
        n_ctx: int | None = None,
        chunk: int = DEFAULT_CHUNK,
        cache_type_k: str = "f16",
        cache_type_v: str = "f16",
        flash_attn: str = "auto",
        n_threads: int | None = None,
        engine: str = "auto",
        method_params: dict[str, object] | None = None,
        observe: int = 0,
        tally: bool = False,
        moments: bool = False,
        scratch_cells: int = 0,
        on_compress: CompressFn | None = None,
        options: ContextOptions | None = None,
        rule: BudgetRule | None = None,
        lanes: Lanes | None = None,
    ) -> None:
        """``model``: a GGUF path, a ``Model``, or an open ``llama_cpp.Llama`` whose loaded
        weights are shared (``Model.from_llama``). The context keywords (cache types, flash
        attention, threads, engine, chunk) make a ``ContextOptions`` and the budget keywords
        (method, budget, ratio, n_ctx, method_params) a ``BudgetRule``; callers that built
        those already (the CLI, the server, the benchmarks) pass ``options`` and ``rule``
        instead. ``observe``: record the newest queries of that many tokens from the start,
        ``tally``: the attention every cell accumulates (H2O), and ``moments``: the statistics
        of every query before RoPE (Expected Attention), for attention methods a later ``use``
        switches to (a method given here records what it needs by itself). ``scratch_cells``:
        cells beside the capacity for a method's own passes (KVzip's), at least what the first
        method asks; a server sizes every pooled context for the methods it serves.
        ``on_compress`` is called after every compression. ``lanes``: take a sequence of that
        shared context instead of a context of its own; the tokens this session generates are
        decoded in one batch with the other lanes' (``edgekv.lanes``: the state engine, and
        every method but those ``Lanes.refusal`` names)."""
        if isinstance(model, Model):
            self.model = model
        elif isinstance(model, (str, Path)):
            self.model = Model(model)
        else:
            self.model = Model.from_llama(model)
        self.on_compress = on_compress
        if options is None:
            options = ContextOptions(cache_type_k, cache_type_v, flash_attn, n_threads, engine, chunk)
        if rule is None:
            arch = self.model.arch
            rule = BudgetRule.make(method, budget=budget, ratio=ratio, params=method_params, n_ctx=n_ctx,
                                   chunk=options.chunk, n_ctx_train=arch.n_ctx_train)
        self.options = options
        self.capacity = rule.capacity  # edgekv's promise in cells; llama.cpp may round its allocation (ctx.n_ctx) up
        first = rule.build()
        scratch = max(first.scratch_cells, scratch_cells)
        n_batch = rule.chunk(first, options.chunk)
        self.lanes = lanes
        self._queued = False  # a generated token waits in the lanes' queue
        self._lane_error: EdgekvError | None = None
        self._check_due = False  # a batched token came in: ask the method's schedule at the next call
        self._last_logits: np.ndarray | None = None  # a lane's own copy of its last row
        if lanes is not None:
            self.ctx, self.seq = self._take_lane(lanes, options, first, rule.capacity + scratch, tally)
            self.engine: KVEngine = StateEngine(self.ctx, seq=self.seq)
        else:
            self.seq = 0
            self.ctx = self._own_context(rule, options, n_batch, scratch)
            self.engine = make_engine(self.ctx, options.engine)
        per_cell = kv_bytes_per_token(self.model.info, options.cache_type_k, options.cache_type_v)
        self.stats = Stats(capacity=rule.capacity, kv_bytes_per_cell=per_cell, scratch_cells=scratch)
        self.n_past = 0  # next position to decode at (pos_max + 1)
        self._sampler: Sampler | None = None
        self._has_logits = False
        try:
            if observe or tally or moments:
                self.engine.observe(max(observe, 1), tally=tally, moments=moments)
            self.apply(rule, first)
        except BaseException:
            if lanes is not None:  # refused: the lane goes back, and its asks of the capture
                self.engine.observe(0)
                lanes.give_back(self.seq)
            raise

    def _own_context(self, rule: BudgetRule, options: ContextOptions, n_batch: int, scratch: int) -> Context:
        arch = self.model.arch
        return Context(
            self.model,
            # iSWA models (Gemma 3): llama.cpp sizes the sliding-window cache min(n_ctx, window +
            # batch), and it must hold a whole window plus a batch however far the positions run,
            # while compression keeps only the full-attention cells within the capacity
            n_ctx=(max(rule.capacity, arch.n_swa + n_batch) if arch.n_swa else rule.capacity) + scratch,
            n_batch=n_batch,
            cache_type_k=options.cache_type_k,
            cache_type_v=options.cache_type_v,
            flash_attn=options.flash_attn,
            n_threads=options.n_threads,
        )

    def _take_lane(self, lanes: Lanes, options: ContextOptions, first: Method, cells: int,
                   tally: bool) -> tuple[Context, int]:
        """The shared context and a free sequence of it, once the session is known to fit."""
        self._refuse_on_lanes(lanes, first)
        if tally:
            raise EdgekvError("a lane records no attention tally: llama.cpp's softmax sums mix the lanes' queries")
        have = lanes.options
        if (options.cache_type_k, options.cache_type_v) != (have.cache_type_k, have.cache_type_v):
            raise EdgekvError(f"a session with a {options.cache_type_k}/{options.cache_type_v} cache cannot take a "
                              f"lane of a {have.cache_type_k}/{have.cache_type_v} context")
        if options.engine == "native":
            raise EdgekvError("a lane runs on the state engine: the native ops act on a context of one sequence")
        if cells > lanes.cells:
            raise BudgetError(f"a session of {cells} cells does not fit a lane of {lanes.cells}")
        if self.model is not lanes.model:
            raise EdgekvError("a lane belongs to a context of another loaded model")
        return lanes.ctx, lanes.take()

    def use(self, method: str | Method, *, budget: int | None = None, ratio: float | None = None,
            scheduled: bool = True, **params: object) -> None:
        """Compress with ``method`` from now on, under a budget or ratio rule (or neither:
        halve when full). ``scheduled=False`` runs the method one-shot: its own schedule
        (LagKV's incremental steps) is never asked, only full caches and explicit
        ``compress`` calls compress. The cache is kept as it is."""
        rule = self.rule.but(method, budget=budget, ratio=ratio, params=params or None)
        self.apply(rule, scheduled=scheduled)

    def apply(self, rule: BudgetRule, method: Method | None = None, *, scheduled: bool = True) -> None:
        """Compress under ``rule`` from now on, with ``method`` when the caller built it with
        ``rule.build()`` already (the server builds one per conversation), else built (and the
        rule checked) here. Refuses, with nothing changed, a method this engine cannot run.
        The cache is kept as it is."""
        if rule.capacity != self.capacity:
            raise BudgetError(f"a rule for --n-ctx {rule.capacity} on a session of {self.capacity} cells")
        method = rule.build() if method is None else method
        self.check_method(method)
        method.attach(self.model.info)
        window = self.engine.window
        size = window.size if window is not None else 0
        eng = self.engine
        if (method.queries_needed > size or (method.tallies and eng.tally is None)
                or (method.query_statistics and eng.moments is None)):
            # records from the next decoded token on
            eng.observe(max(size, method.queries_needed, 1), tally=method.tallies, moments=method.query_statistics)
        method.bind(rule)
        self.rule = rule
        self.method = method
        self.scheduled = scheduled
        self.chunk = min(rule.chunk(method, self.options.chunk), self.ctx.n_batch)
        self._since_compress = 0

    @property
    def budget(self) -> int | None:
        """Cells each compression keeps (the rule's), or None."""
        return self.rule.budget

    @property
    def ratio(self) -> float | None:
        """The fraction each compression removes (the rule's), or None."""
        return self.rule.ratio

    def check_method(self, method: Method) -> None:
        """The one-line error for a method this session's engine cannot run."""
        if self.lanes is not None:
            self._refuse_on_lanes(self.lanes, method)
        missing = method.needs - self.engine.capabilities
        if "queries" in missing:
            raise EdgekvError(f"method {method.name!r} reads the queries, which need edgekv's tensor capture "
                              "(edgekv/_edgekv_capture*.so: run native/build_native.py)")
        if missing:
            raise EdgekvError(
                f"method {method.name!r} needs {', '.join(sorted(missing))}, which the {self.engine.name} engine "
                "lacks (the native engine has it: a patched libllama and a model without sliding-window layers)"
            )

    @staticmethod
    def _refuse_on_lanes(lanes: Lanes, method: Method) -> None:
        if why := lanes.refusal(method):
            raise EdgekvError(f"method {method.name!r} cannot run on a lane of a shared context: {why}")

    def reset(self) -> None:
        """Empty the sequence and its counters for a new document; the context stays allocated."""
        self.settle()
        self.engine.reset()
        self.n_past = 0
        self._since_compress = 0
        self._has_logits = False
        self.stats = Stats(capacity=self.capacity, kv_bytes_per_cell=self.stats.kv_bytes_per_cell,
                           scratch_cells=self.stats.scratch_cells)

    # -- cache ---------------------------------------------------------------
    def compress(self, target: int | None = None, *, scheduled: bool = False) -> None:
        """Compress the cache now, to ``target`` cells (default: the session's budget rule).

        ``scheduled``: this is a step of the method's own schedule (its ``due``
        asked for it), which may keep more than the target. The method is told
        which of the three it is (``methods.base.Why``)."""
        self.settle()
        before = self.engine.n_cells
        if before == 0:
            return
        why: Why = "schedule" if scheduled else "budget" if target is None else "call"
        target = self.rule.target(before) if target is None else target
        if target >= before:
            return
        t0 = time.perf_counter()
        self._since_compress = 0
        with _cyclic_gc_paused():
            self.n_past += self.method.compress(self.engine, target, why=why)
        if self.engine.n_cells >= before:
            return  # the method chose to keep everything (e.g. no complete LagKV partition)
        dt = time.perf_counter() - t0
        s = self.stats
        s.compressions += 1
        s.compress_seconds += dt
        s.cells = self.engine.n_cells
        s.tokens_evicted += before - s.cells
        event = Event(s.tokens_seen, before, s.cells)
        s.events.append(event)
        if self.on_compress is not None:
            self.on_compress(event)
        # The last logits stay valid: they were computed over the uncompressed
        # cache (the best next-token distribution there is), and
        # llama_state_seq_set_data leaves llama.cpp's output buffer alone.

    def _ensure_room(self, n: int) -> None:
        if self.engine.n_cells + n <= self.capacity:
            return
        if not self.method.compresses:
            raise EdgekvError(
                f"context full: {self.engine.n_cells} + {n} tokens exceed n_ctx={self.capacity} and "
                f"method '{self.method.name}' never compresses (use --method or a larger --n-ctx)"
            )
        self._compress_for(n)
        if self.engine.n_cells + n > self.capacity:
            raise BudgetError(
                f"compression left {self.engine.n_cells} cells; {n} more do not fit in n_ctx={self.capacity}"
            )

    def make_room(self, n: int) -> bool:
        """Compress now if fewer than ``n`` cells are free: the compression that feeding ``n``
        tokens would start with, run ahead, so that a chat can run it between turns (while
        the user types) instead of before the next reply's first token. Feeding ``n`` tokens
        (at most a chunk) afterwards compresses no more and leaves the cache as feeding them
        without this call would have: the same window, the same target. Fewer tokens may
        have fit without a compression: the room is the caller's guess at the next turn.
        Returns whether it compressed; a budget too small for ``n`` cells is left to the
        feed to refuse."""
        if n < 1:
            raise EdgekvError(f"make_room: n must be at least 1, got {n}")
        self.settle()
        if not self.method.compresses or self.engine.n_cells + n <= self.capacity:
            return False
        done = self.stats.compressions
        self._compress_for(n)
        return self.stats.compressions > done

    def _compress_for(self, n: int) -> None:
        """Compress until ``n`` more cells fit, or until the method keeps everything: halving
        methods (ratio mode, context shift) may need more than one round."""
        while self.engine.n_cells + n > self.capacity:
            before = self.engine.n_cells
            self.compress()
            if self.engine.n_cells >= before:
                break

    # -- decoding ------------------------------------------------------------
    def prefill(self, tokens: list[int]) -> Iterator[tuple[int, int]]:
        """Decode tokens in chunks, compressing whenever the cache is full; yields (done,
        total) after each chunk, the unit a server interleaves conversations by."""
        self.settle()
        total = len(tokens)
        done = 0
        while done < total:
            n = min(self.chunk, total - done)
            self._ensure_room(n)
            part = tokens[done : done + n]
            before = self.engine.n_cells
            try:
                self.engine.decode(part, self.n_past)
            finally:
                if self.engine.n_cells != before:  # the cells are in, even if recording their queries failed
                    self.n_past += n
            done += n
            if self.lanes is not None:
                self._last_logits = self.ctx.logits(-1)
            self._count(n)
            self._compress_if_due()
            yield done, total

    def _count(self, n: int) -> None:
        s = self.stats
        s.tokens_seen += n
        s.cells = self.engine.n_cells
        s.peak_cells = max(s.peak_cells, s.cells)
        self._has_logits = True
        self._since_compress += n

    def _compress_if_due(self) -> None:
        if self.method.compresses and self.scheduled and self.method.due(self._since_compress, self.stats.cells):
            self.compress(scheduled=True)
            self.stats.cells = self.engine.n_cells

    # -- lanes: a token generated here is decoded with the other lanes' ---------
    def settle(self) -> None:
        """Before anything reads or changes this lane's cache: decode the lanes' queued tokens
        (this session's among them), then run a compression its schedule asked for. Raises
        what went wrong with this lane's part of a batch, once."""
        if self.lanes is None:
            return
        if self._queued:
            self.lanes.flush()
        if self._lane_error is not None:
            e, self._lane_error = self._lane_error, None
            raise EdgekvError(f"a batched step of this session failed: {e}")
        if self._check_due:
            self._check_due = False
            self._compress_if_due()

    def _lane_decoded(self, token: int, pos: int, logits: np.ndarray, row: int, batch: int) -> None:
        """``Lanes.flush`` decoded this session's queued token, the ``row``-th of ``batch``."""
        self._queued = False
        self.n_past = pos + 1
        self._last_logits = logits
        self._check_due = True
        try:
            self.engine.decoded([token], pos, first=row, batch=batch)
        finally:  # the cell is in, even if recording its queries failed
            self._count(1)

    def _lane_failed(self, error: EdgekvError) -> None:
        self._queued = False
        self._lane_error = error

    def discard_queued(self) -> None:
        """Forget what this lane queued or was told and not yet raised: its conversation is
        dropped mid-turn, and its cache is emptied before the session serves another."""
        if self.lanes is not None and self._queued:
            self.lanes.unqueue(self.seq)
        self._queued, self._lane_error, self._check_due = False, None, False

    def feed(self, tokens: list[int], progress: ProgressFn | None = None) -> None:
        """Decode tokens in chunks, compressing whenever the cache is full."""
        for done, total in self.prefill(tokens):
            if progress:
                progress(done, total)

    def fits(self, n: int) -> bool:
        """Whether ``n`` more tokens fit: always for a compressing method, else while the
        cache has room (a full cache's method refuses or stops instead of overflowing)."""
        return self.method.compresses or self.engine.n_cells + self._queued + n <= self.capacity

    def feed_text(self, text: str, *, add_special: bool | None = None, progress: ProgressFn | None = None) -> int:
        if add_special is None:
            add_special = self.n_past == 0
        toks = self.model.tokenize(text, add_special=add_special, parse_special=True)
        self.feed(toks, progress)
        return len(toks)

    def logits(self) -> np.ndarray:
        self.settle()
        if not self._has_logits:
            raise EdgekvError("no logits: feed at least one token after the last compression")
        if self.lanes is not None:
            assert self._last_logits is not None
            return self._last_logits.copy()
        return self.ctx.logits(-1)

    def _get_sampler(self, cfg: SamplerConfig) -> Sampler:
        if self._sampler is None or self._sampler.cfg != cfg:
            if self._sampler is not None:
                self._sampler.close()
            self._sampler = Sampler(cfg)
        return self._sampler

    def reset_sampler(self) -> None:
        """Start sampling afresh: the next token draws from the configured seed again (the
        sampler's random state otherwise carries on from call to call)."""
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None

    def step(self, sampler: SamplerConfig | None = None) -> int | None:
        """Sample one token and feed it back; None at end-of-generation (nothing is fed then).
        The unit a server interleaves conversations by."""
        self.settle()
        if not self._has_logits:
            raise EdgekvError("nothing to continue from: feed a prompt first")
        chain = self._get_sampler(sampler or SamplerConfig())
        if self.lanes is None:
            tok = chain.sample(self.ctx)
        else:
            assert self._last_logits is not None
            tok = chain.sample_logits(self._last_logits)
        if self.model.is_eog(tok):
            return None
        if self.lanes is None:
            self.feed([tok])
            return tok
        # decoded with the other lanes' tokens, when any lane next needs its cache
        self._ensure_room(1)
        self.lanes.queue(self, self.seq, tok, self.n_past)
        self._queued = True
        return tok

    def generate_tokens(self, max_tokens: int, sampler: SamplerConfig | None = None) -> Iterator[int]:
        """Sample up to max_tokens, stopping at end-of-generation; each sampled token is fed back."""
        for _ in range(max_tokens):
            tok = self.step(sampler)
            if tok is None:
                return
            yield tok

    def stream(self, max_tokens: int, sampler: SamplerConfig | None = None, *, stop: tuple[str, ...] = (),
               reply: Reply | None = None, until_full: bool = False) -> Iterator[str]:
        """Generate up to ``max_tokens`` tokens as text, one yield per token: the text that can
        be sent now, "" while nothing can (a multi-byte character or the start of a stop
        string is held back). Ends at end-of-generation or at a stop string (neither is sent);
        ``until_full``: a method that never compresses ends when the cache is full instead of
        failing. ``reply`` records why it ended, the tokens and the text sent."""
        reply = Reply() if reply is None else reply
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        pending = ""  # generated text that may begin a stop string
        cut = False
        for _ in range(max_tokens):
            if until_full and not self.fits(1):
                break  # "length", as OpenAI reports a context-bound reply
            tok = self.step(sampler)
            if tok is None:
                reply.finish = "stop"
                break
            reply.tokens += 1
            pending += dec.decode(self.model.piece(tok))
            hit = min((i for i in (pending.find(s) for s in stop) if i >= 0), default=-1)
            if hit >= 0:
                pending, reply.finish, cut = pending[:hit], "stop", True
                break
            keep = _hold_back(pending, stop)
            out, pending = pending[: len(pending) - keep], pending[len(pending) - keep :]
            reply.text += out
            yield out
        tail = pending if cut else pending + dec.decode(b"", final=True)
        if tail:
            reply.text += tail
            yield tail

    def generate(self, max_tokens: int, sampler: SamplerConfig | None = None) -> Iterator[str]:
        """Stream text; bytes of multi-byte characters are joined before they are yielded."""
        return (piece for piece in self.stream(max_tokens, sampler) if piece)

    # -- state ---------------------------------------------------------------
    def save(self) -> tuple[CacheState, int, int]:
        """Save the sequence (cache, position, counters) to branch or reuse a prefill."""
        self.settle()
        return self.engine.save(), self.n_past, self.stats.tokens_seen

    def restore(self, saved: tuple[CacheState, int, int]) -> None:
        state, n_past, seen = saved
        if not isinstance(state, CacheState):
            raise EdgekvError("restore() takes what save() returned")
        self.settle()
        self.engine.restore(state)
        self.n_past = n_past
        self.stats.tokens_seen = seen
        self.stats.cells = self.engine.n_cells
        self._since_compress = 0
        self._has_logits = False

    def save_file(self, path: str | Path) -> None:
        """Write the sequence to a file a later session (same model and cache types) can load."""
        self.settle()
        arch = self.model.arch
        save_cache_file(path, self.engine.save(), {
            "model": self.model.path.name, "model_size": self.model.path.stat().st_size,
            "n_layer": arch.n_layer, "n_head_kv": arch.n_head_kv, "cache_type_k": self.ctx.cache_type_k,
            "cache_type_v": self.ctx.cache_type_v, "flash_attn": self.ctx.flash_attn, "n_past": self.n_past,
            "tokens_seen": self.stats.tokens_seen,
        })

    def load_file(self, path: str | Path) -> None:
        """Load a saved sequence; every check happens before the live cache is touched."""
        state, header = load_cache_file(path, self.engine.name)
        arch = self.model.arch
        if (header["model"], header["model_size"], header["n_layer"]) != (
            self.model.path.name, self.model.path.stat().st_size, arch.n_layer
        ):
            raise EdgekvError(f"{path} was saved with model {header['model']}, this session runs {self.model.path.name}")
        for key in ("cache_type_k", "cache_type_v"):
            if header[key] != getattr(self.ctx, key):
                raise EdgekvError(
                    f"{path} holds a {header[key]} cache ({key.replace('_', '-')}), "
                    f"this session uses cache type {getattr(self.ctx, key)}"
                )
        if state.bias and "bias" not in self.engine.capabilities:
            raise EdgekvError(f"{path} holds merged cells that attention weighs by their counts (the log-count "
                              "bias), which only the native engine applies")
        self.restore((state, header["n_past"], header["tokens_seen"]))

    def close(self) -> None:
        """Free the context, or give the lane back (its cells freed, a queued token dropped)."""
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        if self.lanes is None:
            self.ctx.close()
        elif self.seq >= 0:
            self.engine.observe(0)  # its asks of the shared tensor capture go back too
            self.lanes.give_back(self.seq)
            self._queued, self.seq = False, -1

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Chat:
    """Multi-turn chat on a Session, rendered with the model's GGUF chat template.

    Each turn feeds only the text the template adds since the last turn, so
    earlier turns are never re-decoded; they live (compressed) in the cache. That text
    is rendered over the last exchange alone (and the system message), so a turn costs
    the same time and transient memory at turn 1000 as at turn 2.
    """

    def __init__(self, session: Session, system: str | None = None) -> None:
        self.session = session
        self.messages: list[dict[str, str]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self._held = False  # the cache holds every message so far, the last reply as decoded
        self._rebuild = False  # an interrupt left the cache out of step with the messages

    def send(self, text: str, *, max_tokens: int = 256, sampler: SamplerConfig | None = None,
             progress: ProgressFn | None = None) -> Iterator[str]:
        """Feed the new turn and stream the reply. Closing the stream early (a user's Ctrl-C
        between pieces) keeps the reply so far as the assistant's message. An interrupt while
        llama.cpp works (the prefill, a step) may leave the cache half-fed, so the message
        fed is dropped (prefill) or the reply so far kept (a step), and the next turn rebuilds
        the cache from the messages: nothing said is lost, nothing half-fed is kept."""
        self.messages.append({"role": "user", "content": text})
        if self._rebuild:
            self.session.reset()
            self._held = self._rebuild = False
        new_text = self._new_text()
        try:
            self.session.feed_text(new_text, add_special=self.session.n_past == 0, progress=progress)
        except KeyboardInterrupt:
            self.messages.pop()
            self._rebuild = True
            raise
        reply: list[str] = []
        try:
            for piece in self.session.generate(max_tokens, sampler):
                reply.append(piece)
                yield piece
        except KeyboardInterrupt:
            self._rebuild = True
            raise
        finally:
            self.messages.append({"role": "assistant", "content": "".join(reply)})
            self._held = True

    def _new_text(self) -> str:
        return turn_text(self.session.model.apply_chat_template, self.messages, self._held)


def turn_text(render: Callable[..., str], messages: list[dict[str, str]], held: bool) -> str:
    """The text a chat template adds for the newest message: everything rendered when the
    cache holds nothing of the chat, else what follows the text the cache holds (the
    messages before, the last reply as decoded). That is rendered over the system message,
    the last exchange and the new message alone: the text a template writes for a message
    depends on its neighbours and on the first messages, which both renderings share
    (``tests/test_session.py`` checks every format llama.cpp knows)."""
    if not held:
        return render(messages, add_assistant=True)
    head = messages[:1] if messages[0]["role"] == "system" else []
    window = head + messages[max(len(head), len(messages) - 3):]
    before = render(window[:-2], add_assistant=True) + window[-2]["content"]
    new = render(window, add_assistant=True)
    return new[common_prefix(before, new):]


def common_prefix(a: str, b: str, block: int = 4096) -> int:
    """Length of the longest common prefix of two strings. Blocks are compared as slices
    (in C): a whole rendered transcript is compared in microseconds, not a Python loop."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + block] == b[i : i + block]:
        i += block
    if i >= n:
        return n
    end = min(i + block, n)
    while i < end and a[i] == b[i]:
        i += 1
    return i


__all__ = ["Chat", "Event", "Reply", "SamplerConfig", "Session", "Stats"]
