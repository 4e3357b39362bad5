"""A sequence whose KV cache never outgrows its context.

``Session`` drives llama.cpp's low-level API: prompts are decoded in chunks,
and whenever the next chunk would not fit in ``n_ctx`` cells the cache is
compressed by the configured method, through the engine, and decoding goes
on. So a prompt far longer than ``n_ctx`` is processed in bounded KV memory,
and a chat never runs out of context.

Budget conventions (the CLI documents the same):

- ``budget=N``: each compression brings the cache down to N cells. A cell is
  one cached token per (layer, KV head); memory is ``N x kv_bytes_per_cell``.
- ``ratio=R``: each compression *removes* a fraction R of the cells present
  (kvpress's ``compression_ratio``; R=0.75 keeps 25 %).
"""

from __future__ import annotations

import codecs
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .errors import BudgetError, EdgekvError
from .gguf_info import kv_bytes_per_token
from .kvcache import CacheState, make_engine
from .kvcache.files import load_cache_file, save_cache_file
from .llama import Context, Model, Sampler, SamplerConfig
from .methods import Method, get_method

ProgressFn = Callable[[int, int], None]


class Event(NamedTuple):
    """One compression: tokens seen when it ran, cells before and after."""

    tokens_seen: int
    before: int
    after: int


CompressFn = Callable[[Event], None]


@dataclass
class Stats:
    """Counters a user (or a test) can read at any time."""

    capacity: int  # cells the session may hold (its --n-ctx)
    kv_bytes_per_cell: int
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
        return self.capacity * self.kv_bytes_per_cell

    @property
    def kept_fraction(self) -> float:
        return self.cells / self.tokens_seen if self.tokens_seen else 1.0


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
        chunk: int = 256,
        cache_type_k: str = "f16",
        cache_type_v: str = "f16",
        flash_attn: str = "auto",
        n_threads: int | None = None,
        engine: str = "auto",
        method_params: dict[str, object] | None = None,
        observe: int = 0,
        tally: bool = False,
        on_compress: CompressFn | None = None,
    ) -> None:
        """``model``: a GGUF path, a ``Model``, or an open ``llama_cpp.Llama`` whose loaded
        weights are shared (``Model.from_llama``). ``observe``: record the newest queries of
        that many tokens from the start, and ``tally``: the attention every cell accumulates
        (H2O), for attention methods a later ``use`` switches to (a method given here records
        what it needs by itself). ``on_compress`` is called after every compression."""
        if isinstance(model, Model):
            self.model = model
        elif isinstance(model, (str, Path)):
            self.model = Model(model)
        else:
            self.model = Model.from_llama(model)
        self.on_compress = on_compress
        method = method if isinstance(method, Method) else get_method(method, **(method_params or {}))
        if chunk < 1:
            raise BudgetError(f"chunk must be positive, got {chunk}")
        arch = self.model.arch
        if n_ctx is None:
            n_ctx = budget + chunk if budget is not None else min(arch.n_ctx_train or 4096, 4096)
        self.capacity = n_ctx  # edgekv's promise in cells; llama.cpp may round its allocation (ctx.n_ctx) up
        self._chunk_request = chunk
        check_budget(method, budget, ratio, n_ctx)
        n_batch = _chunk_for(method, budget, ratio, n_ctx, chunk)
        self.ctx = Context(
            self.model,
            # iSWA models (Gemma 3): llama.cpp sizes the sliding-window cache min(n_ctx, window +
            # batch), and it must hold a whole window plus a batch however far the positions run,
            # while compression keeps only the full-attention cells within the capacity
            n_ctx=max(n_ctx, arch.n_swa + n_batch) if arch.n_swa else n_ctx,
            n_batch=n_batch,
            cache_type_k=cache_type_k,
            cache_type_v=cache_type_v,
            flash_attn=flash_attn,
            n_threads=n_threads,
        )
        self.engine = make_engine(self.ctx, engine)
        per_cell = kv_bytes_per_token(self.model.info, cache_type_k, cache_type_v)
        self.stats = Stats(capacity=n_ctx, kv_bytes_per_cell=per_cell)
        self.n_past = 0  # next position to decode at (pos_max + 1)
        self._sampler: Sampler | None = None
        self._has_logits = False
        if observe or tally:
            self.engine.observe(max(observe, 1), tally=tally)
        self.use(method, budget=budget, ratio=ratio)

    def use(self, method: str | Method, *, budget: int | None = None, ratio: float | None = None,
            scheduled: bool = True, **params: object) -> None:
        """Compress with ``method`` from now on, under a budget or ratio rule (or neither:
        halve when full). ``scheduled=False`` runs the method one-shot: its own schedule
        (LagKV's incremental steps) is never asked, only full caches and explicit
        ``compress`` calls compress. The cache is kept as it is."""
        method = method if isinstance(method, Method) else get_method(method, **params)
        missing = method.needs - self.engine.capabilities
        if "queries" in missing:
            raise EdgekvError(f"method {method.name!r} reads the queries, which need edgekv's tensor capture "
                              "(edgekv/_edgekv_capture*.so: run native/build_native.py)")
        if missing:
            raise EdgekvError(
                f"method {method.name!r} needs {', '.join(sorted(missing))}, which the {self.engine.name} engine "
                "lacks (the native engine has it: a patched libllama and a model without sliding-window layers)"
            )
        check_budget(method, budget, ratio, self.capacity)
        method.attach(self.model.info)
        window = self.engine.window
        size = window.size if window is not None else 0
        if method.queries_needed > size or (method.tallies and self.engine.tally is None):
            # records from the next decoded token on
            self.engine.observe(max(size, method.queries_needed), tally=method.tallies or self.engine.tally is not None)
        method.bind(budget, ratio)
        self.method = method
        self.budget = budget
        self.ratio = ratio
        self.scheduled = scheduled
        self.chunk = min(_chunk_for(method, budget, ratio, self.capacity, self._chunk_request), self.ctx.n_batch)
        self._since_compress = 0

    def reset(self) -> None:
        """Empty the sequence and its counters for a new document; the context stays allocated."""
        self.engine.reset()
        self.n_past = 0
        self._since_compress = 0
        self._has_logits = False
        self.stats = Stats(capacity=self.capacity, kv_bytes_per_cell=self.stats.kv_bytes_per_cell)

    # -- cache ---------------------------------------------------------------
    def _target(self, cells: int) -> int:
        if self.budget is not None:
            return self.budget
        if self.ratio is not None:
            return max(1, math.floor(cells * (1.0 - self.ratio)))
        return max(1, cells // 2)  # method given without budget/ratio: halve, like context shift

    def compress(self, target: int | None = None, *, scheduled: bool = False) -> None:
        """Compress the cache now, to ``target`` cells (default: the session's budget rule).

        ``scheduled``: this is a step of the method's own schedule (its ``due``
        asked for it), which may keep more than the target."""
        before = self.engine.n_cells
        if before == 0:
            return
        target = self._target(before) if target is None else target
        if target >= before:
            return
        t0 = time.perf_counter()
        self._since_compress = 0
        self.n_past += self.method.compress(self.engine, target, scheduled=scheduled)
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
        # Halving methods (ratio mode, context shift) may need more than one round.
        while self.engine.n_cells + n > self.capacity:
            before = self.engine.n_cells
            self.compress()
            if self.engine.n_cells >= before:
                break
        if self.engine.n_cells + n > self.capacity:
            raise BudgetError(
                f"compression left {self.engine.n_cells} cells; {n} more do not fit in n_ctx={self.capacity}"
            )

    # -- decoding ------------------------------------------------------------
    def feed(self, tokens: list[int], progress: ProgressFn | None = None) -> None:
        """Decode tokens in chunks, compressing whenever the cache is full."""
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
            s = self.stats
            s.tokens_seen += n
            s.cells = self.engine.n_cells
            s.peak_cells = max(s.peak_cells, s.cells)
            self._has_logits = True
            self._since_compress += n
            if self.method.compresses and self.scheduled and self.method.due(self._since_compress, s.cells):
                self.compress(scheduled=True)
                s.cells = self.engine.n_cells
            if progress:
                progress(done, total)

    def feed_text(self, text: str, *, add_special: bool | None = None, progress: ProgressFn | None = None) -> int:
        if add_special is None:
            add_special = self.n_past == 0
        toks = self.model.tokenize(text, add_special=add_special, parse_special=True)
        self.feed(toks, progress)
        return len(toks)

    def logits(self) -> np.ndarray:
        if not self._has_logits:
            raise EdgekvError("no logits: feed at least one token after the last compression")
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
        if not self._has_logits:
            raise EdgekvError("nothing to continue from: feed a prompt first")
        tok = self._get_sampler(sampler or SamplerConfig()).sample(self.ctx)
        if self.model.is_eog(tok):
            return None
        self.feed([tok])
        return tok

    def generate_tokens(self, max_tokens: int, sampler: SamplerConfig | None = None) -> Iterator[int]:
        """Sample up to max_tokens, stopping at end-of-generation; each sampled token is fed back."""
        for _ in range(max_tokens):
            tok = self.step(sampler)
            if tok is None:
                return
            yield tok

    def generate(self, max_tokens: int, sampler: SamplerConfig | None = None) -> Iterator[str]:
        """Stream text; bytes of multi-byte characters are joined before they are yielded."""
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        for tok in self.generate_tokens(max_tokens, sampler):
            piece = dec.decode(self.model.piece(tok))
            if piece:
                yield piece
        tail = dec.decode(b"", final=True)
        if tail:
            yield tail

    # -- state ---------------------------------------------------------------
    def save(self) -> tuple[CacheState, int, int]:
        """Save the sequence (cache, position, counters) to branch or reuse a prefill."""
        return self.engine.save(), self.n_past, self.stats.tokens_seen

    def restore(self, saved: tuple[CacheState, int, int]) -> None:
        state, n_past, seen = saved
        if not isinstance(state, CacheState):
            raise EdgekvError("restore() takes what save() returned")
        self.engine.restore(state)
        self.n_past = n_past
        self.stats.tokens_seen = seen
        self.stats.cells = self.engine.n_cells
        self._since_compress = 0
        self._has_logits = False

    def save_file(self, path: str | Path) -> None:
        """Write the sequence to a file a later session (same model and cache types) can load."""
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
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        self.ctx.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_budget(method: Method, budget: int | None, ratio: float | None, capacity: int) -> None:
    """The one-line errors for a budget rule this session cannot keep."""
    if budget is not None and ratio is not None:
        raise BudgetError("give either --budget or --ratio, not both")
    if ratio is not None and not 0.0 < ratio < 1.0:
        raise BudgetError(f"--ratio is the fraction removed and must be in (0, 1), got {ratio}")
    if budget is not None and budget < 1:
        raise BudgetError(f"--budget must be a positive number of cells, got {budget}")
    if budget is not None and budget >= capacity:
        raise BudgetError(f"--budget {budget} must be below --n-ctx {capacity} (room to decode after compressing)")
    if (method.compresses and not method.shifts_positions and budget is not None
            and budget <= method.sinks + method.window):
        raise BudgetError(
            f"--budget {budget} leaves no room beyond the {method.sinks} sinks + "
            f"{method.window}-token window that {method.name} always keeps"
        )


def _chunk_for(method: Method, budget: int | None, ratio: float | None, capacity: int, chunk: int) -> int:
    """Prefill chunk size: a compression must leave room for the next chunk. With a
    budget that is capacity - budget; otherwise at least the fraction a compression removes."""
    if budget is not None:
        return min(chunk, capacity - budget)
    if ratio is not None:
        return max(1, min(chunk, math.floor(capacity * ratio)))
    if method.compresses:
        return max(1, min(chunk, capacity // 2))
    return min(chunk, capacity)


class Chat:
    """Multi-turn chat on a Session, rendered with the model's GGUF chat template.

    Each turn feeds only the text the template adds since the last turn, so
    earlier turns are never re-decoded; they live (compressed) in the cache.
    """

    def __init__(self, session: Session, system: str | None = None) -> None:
        self.session = session
        self.messages: list[dict[str, str]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self._rendered = ""

    def send(self, text: str, *, max_tokens: int = 256, sampler: SamplerConfig | None = None,
             progress: ProgressFn | None = None) -> Iterator[str]:
        self.messages.append({"role": "user", "content": text})
        prompt = self.session.model.apply_chat_template(self.messages, add_assistant=True)
        common = common_prefix(self._rendered, prompt)
        self.session.feed_text(prompt[common:], add_special=self.session.n_past == 0, progress=progress)
        reply: list[str] = []
        for piece in self.session.generate(max_tokens, sampler):
            reply.append(piece)
            yield piece
        answer = "".join(reply)
        self.messages.append({"role": "assistant", "content": answer})
        # What the cache now represents: the prompt plus the reply as decoded.
        self._rendered = prompt + answer


def common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


__all__ = ["Chat", "Event", "SamplerConfig", "Session", "Stats"]
