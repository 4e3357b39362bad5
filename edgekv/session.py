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
import ctypes
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import BudgetError, EdgekvError
from .kvcache.engine import CacheState, KVEngine, StateEngine
from .kvcache.quant import row_size
from .llama import Context, Model, lib
from .methods import Method, get_method

ProgressFn = Callable[[int, int], None]
SESSION_MAGIC = b"EDGEKV\x00\x01"
SESSION_FILE_VERSION = 1


@dataclass
class Stats:
    """Counters a user (or a test) can read at any time."""

    n_ctx: int
    kv_bytes_per_cell: int
    cells: int = 0
    peak_cells: int = 0
    compressions: int = 0
    tokens_seen: int = 0
    tokens_evicted: int = 0
    compress_seconds: float = 0.0
    events: list[tuple[int, int, int]] = field(default_factory=list)  # (tokens_seen, before, after)

    @property
    def kv_bytes(self) -> int:
        return self.cells * self.kv_bytes_per_cell

    @property
    def kv_bytes_allocated(self) -> int:
        return self.n_ctx * self.kv_bytes_per_cell

    @property
    def kept_fraction(self) -> float:
        return self.cells / self.tokens_seen if self.tokens_seen else 1.0


@dataclass
class SamplerConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = 0


def make_engine(ctx: Context, kind: str = "auto") -> KVEngine:
    """``auto``: the native ops when the loaded libllama has them and they handle this
    cache, the portable state engine otherwise."""
    from .kvcache.native import NativeEngine, NativeUnsupported

    if kind == "state":
        return StateEngine(ctx)
    if kind in ("auto", "native"):
        try:
            return NativeEngine(ctx)
        except NativeUnsupported:
            if kind == "native":
                raise
            return StateEngine(ctx)
    raise EdgekvError(f"unknown engine {kind!r}; use auto, state or native")


class Session:
    """One sequence on one model, with bounded-memory decoding."""

    def __init__(
        self,
        model: Model | str | Path,
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
    ) -> None:
        self.model = model if isinstance(model, Model) else Model(model)
        self.method = method if isinstance(method, Method) else get_method(method, **(method_params or {}))
        if budget is not None and ratio is not None:
            raise BudgetError("give either --budget or --ratio, not both")
        if ratio is not None and not 0.0 < ratio < 1.0:
            raise BudgetError(f"--ratio is the fraction removed and must be in (0, 1), got {ratio}")
        if budget is not None and budget < 1:
            raise BudgetError(f"--budget must be a positive number of cells, got {budget}")
        if chunk < 1:
            raise BudgetError(f"chunk must be positive, got {chunk}")
        arch = self.model.arch
        if n_ctx is None:
            n_ctx = budget + chunk if budget is not None else min(arch.n_ctx_train or 4096, 4096)
        if budget is not None and budget >= n_ctx:
            raise BudgetError(f"--budget {budget} must be below --n-ctx {n_ctx} (room to decode after compressing)")
        if (self.method.compresses and not self.method.shifts_positions and budget is not None
                and budget <= self.method.sinks + self.method.window):
            raise BudgetError(
                f"--budget {budget} leaves no room beyond the {self.method.sinks} sinks + "
                f"{self.method.window}-token window that {self.method.name} always keeps"
            )
        self.budget = budget
        self.ratio = ratio
        self.method.bind(budget, ratio)
        self._since_compress = 0
        # A compression must leave room for the next chunk: with a budget that is
        # n_ctx - budget; otherwise at least the fraction a compression removes.
        if budget is not None:
            self.chunk = min(chunk, n_ctx - budget)
        elif ratio is not None:
            self.chunk = max(1, min(chunk, math.floor(n_ctx * ratio)))
        elif self.method.compresses:
            self.chunk = max(1, min(chunk, n_ctx // 2))
        else:
            self.chunk = min(chunk, n_ctx)
        self.ctx = Context(
            self.model,
            n_ctx=n_ctx,
            n_batch=max(self.chunk, 1),
            cache_type_k=cache_type_k,
            cache_type_v=cache_type_v,
            flash_attn=flash_attn,
            n_threads=n_threads,
        )
        self.capacity = n_ctx  # what we promise; llama.cpp may round its allocation up
        self.engine = make_engine(self.ctx, engine)
        per_cell = arch.n_layer * (
            row_size(_tid(cache_type_k), arch.n_head_kv * arch.head_dim_k)
            + row_size(_tid(cache_type_v), arch.n_head_kv * arch.head_dim_v)
        )
        self.stats = Stats(n_ctx=n_ctx, kv_bytes_per_cell=per_cell)
        self.n_past = 0  # next position to decode at (pos_max + 1)
        self._sampler = None
        self._sampler_cfg: SamplerConfig | None = None
        self._has_logits = False

    def reset(self) -> None:
        """Empty the sequence and its counters for a new document; the context stays allocated."""
        self.ctx.clear()
        self.engine.reset()
        self.n_past = 0
        self._since_compress = 0
        self._has_logits = False
        self.stats = Stats(n_ctx=self.stats.n_ctx, kv_bytes_per_cell=self.stats.kv_bytes_per_cell)

    # -- cache ---------------------------------------------------------------
    def _target(self, cells: int) -> int:
        if self.budget is not None:
            return self.budget
        if self.ratio is not None:
            return max(1, math.floor(cells * (1.0 - self.ratio)))
        return max(1, cells // 2)  # method given without budget/ratio: halve, like context shift

    def compress(self, target: int | None = None) -> None:
        """Compress the cache now, to ``target`` cells (default: the session's budget rule)."""
        before = self.engine.n_cells
        if before == 0:
            return
        target = self._target(before) if target is None else target
        if target >= before:
            return
        t0 = time.perf_counter()
        self._since_compress = 0
        if self.method.shifts_positions:
            # llama.cpp's context shift: positions move, so n_past moves with them.
            self.n_past -= self.engine.shift(self.method.n_keep, self.method.n_discard(before))
        else:
            snap = self.engine.snapshot()
            keep = self.method.select(snap, target)
            if keep.shape[2] >= before:
                return  # the method chose to keep everything (e.g. no complete LagKV partition)
            self.engine.compact(keep)
        dt = time.perf_counter() - t0
        s = self.stats
        s.compressions += 1
        s.compress_seconds += dt
        s.cells = self.engine.n_cells
        s.tokens_evicted += before - s.cells
        s.events.append((s.tokens_seen, before, s.cells))
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
            self.ctx.decode(part, self.n_past, logits_last=True)
            self.engine.note_decoded(n)
            self.n_past += n
            done += n
            s = self.stats
            s.tokens_seen += n
            s.cells = self.engine.n_cells
            s.peak_cells = max(s.peak_cells, s.cells)
            self._has_logits = True
            self._since_compress += n
            if self.method.compresses and self.method.due(self._since_compress, s.cells):
                self.compress()
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

    def _get_sampler(self, cfg: SamplerConfig):
        L = lib()
        if self._sampler is not None and self._sampler_cfg == cfg:
            return self._sampler
        if self._sampler is not None:
            L.llama_sampler_free(self._sampler)
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if cfg.temperature <= 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        else:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(cfg.top_k))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(cfg.top_p, 1))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(cfg.min_p, 1))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(cfg.temperature))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(cfg.seed))
        self._sampler, self._sampler_cfg = chain, cfg
        return chain

    def generate_tokens(self, max_tokens: int, sampler: SamplerConfig | None = None) -> Iterator[int]:
        """Sample up to max_tokens, stopping at end-of-generation; each sampled token is fed back."""
        L = lib()
        chain = self._get_sampler(sampler or SamplerConfig())
        if not self._has_logits:
            raise EdgekvError("nothing to continue from: feed a prompt first")
        for _ in range(max_tokens):
            tok = L.llama_sampler_sample(chain, self.ctx.ptr, -1)
            if self.model.is_eog(tok):
                self._last_eog = tok
                return
            yield tok
            self.feed([tok])

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
        import json

        state = self.engine.save()
        arch = self.model.arch
        header = {
            "version": SESSION_FILE_VERSION, "model": self.model.path.name, "model_size": self.model.path.stat().st_size,
            "n_layer": arch.n_layer, "n_head_kv": arch.n_head_kv, "cache_type_k": self.ctx.cache_type_k,
            "cache_type_v": self.ctx.cache_type_v, "flash_attn": self.ctx.flash_attn, "n_past": self.n_past,
            "tokens_seen": self.stats.tokens_seen, "token_pos_shape": list(state.token_pos.shape),
            "blob_len": len(state.blob),
            # the native engine's log-count bias of merged cells, after the blob (float32)
            "bias_shape": list(state.bias.shape) if state.bias is not None else None,
        }
        hb = json.dumps(header).encode()
        tmp = Path(str(path) + ".part")
        with open(tmp, "wb") as f:
            f.write(SESSION_MAGIC + len(hb).to_bytes(4, "little") + hb)
            f.write(state.token_pos.astype("<i4").tobytes())
            f.write(state.blob)
            if state.bias is not None:
                f.write(state.bias.astype("<f4").tobytes())
        tmp.replace(path)

    def load_file(self, path: str | Path) -> None:
        """Load a saved sequence; every check happens before the live cache is touched."""
        import json

        path = Path(path)
        if not path.is_file():
            raise EdgekvError(f"session file {path} does not exist")
        data = path.read_bytes()
        if not data.startswith(SESSION_MAGIC):
            raise EdgekvError(f"{path} is not an edgekv session file")
        try:
            hl = int.from_bytes(data[8:12], "little")
            header = json.loads(data[12 : 12 + hl])
        except (ValueError, UnicodeDecodeError) as e:
            raise EdgekvError(f"{path}: session header is corrupt or truncated ({e})") from e
        if header.get("version") != SESSION_FILE_VERSION:
            raise EdgekvError(f"{path}: session file version {header.get('version')} is not supported")
        shape = tuple(header["token_pos_shape"])
        off = 12 + hl
        n_tp = int(np.prod(shape)) * 4
        bias_shape = header.get("bias_shape")
        n_bias = int(np.prod(bias_shape)) * 4 if bias_shape else 0
        if len(data) != off + n_tp + header["blob_len"] + n_bias:
            raise EdgekvError(f"{path}: session file is truncated or has extra bytes")
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
        token_pos = np.frombuffer(data[off : off + n_tp], dtype="<i4").reshape(shape).astype(np.int32)
        end = off + n_tp + header["blob_len"]
        bias = np.frombuffer(data[end:], dtype="<f4").reshape(bias_shape).astype(np.float32) if bias_shape else None
        if bias is not None and not hasattr(self.engine, "bias_set"):
            raise EdgekvError(f"{path} holds merged cells (a log-count bias), which only the native engine can load")
        state = CacheState(blob=data[off + n_tp : end], token_pos=token_pos, engine=self.engine.name, bias=bias)
        self.restore((state, header["n_past"], header["tokens_seen"]))

    def close(self) -> None:
        if self._sampler is not None:
            lib().llama_sampler_free(self._sampler)
            self._sampler = None
        self.ctx.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tid(name: str) -> int:
    from .kvcache.quant import type_by_name

    return type_by_name(name).id


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
        common = _common_prefix(self._rendered, prompt)
        self.session.feed_text(prompt[common:], add_special=self.session.n_past == 0, progress=progress)
        reply: list[str] = []
        for piece in self.session.generate(max_tokens, sampler):
            reply.append(piece)
            yield piece
        answer = "".join(reply)
        self.messages.append({"role": "assistant", "content": answer})
        # What the cache now represents: the prompt plus the reply as decoded.
        self._rendered = prompt + answer


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


__all__ = ["Chat", "SamplerConfig", "Session", "Stats"]


def native_available() -> bool:
    """True when the loaded libllama carries edgekv's patch set."""
    import llama_cpp.llama_cpp as L

    return hasattr(L._lib, "llama_edgekv_api_version")


def engine_summary() -> str:
    lib()
    import llama_cpp.llama_cpp as L

    from .kvcache.native import api_version

    if native_available():
        fn = L._lib.llama_edgekv_api_version
        fn.restype = ctypes.c_int32
        v = fn()
        if api_version():
            return (f"engine: native (libllama carries edgekv patch set v{v}; compaction, merge with "
                    "log-count bias, read and score run where the cache lives; iSWA caches use the state engine)")
        return (f"engine: state (portable); libllama carries edgekv patch set v{v} but the cffi bindings "
                "are not built (run native/build_native.py)")
    return "engine: state (portable; stock libllama without edgekv's patch set)"
