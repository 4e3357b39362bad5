"""Thin, explicit layer over libllama's C API (through llama-cpp-python's ctypes).

edgekv drives llama.cpp's low-level API itself: the high-level ``llama_cpp.Llama``
assumes the KV cache holds exactly the tokens it has seen, which stops being
true after the first compression (docs/design.md section 2).
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .capture import Capture
from .capture import available as capture_available
from .errors import EdgekvError, ModelError
from .ggml_types import type_by_name

if TYPE_CHECKING:
    from .gguf_info import ModelInfo

# Populated lazily: importing llama_cpp loads libllama, which is slow-ish and
# must not happen for `edgekv --help`.
_L = None
_log_cb = None
_log_tail: list[str] = []
_creation_log: list[str] | None = None  # all log lines inside _logged() (a load, a context creation)
_verbose = bool(os.environ.get("EDGEKV_VERBOSE"))

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


def lib():
    """The llama_cpp ctypes module, with the backend initialised and logs captured."""
    global _L, _log_cb
    if _L is not None:
        return _L
    try:
        import llama_cpp.llama_cpp as L
    except Exception as e:  # pragma: no cover - install problem
        raise EdgekvError(f"cannot load libllama through llama-cpp-python: {e}") from e

    @L.llama_log_callback
    def _cb(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        msg = text.decode("utf-8", "replace") if text else ""
        if msg.strip():
            _log_tail.append(msg.rstrip())
            del _log_tail[:-50]
            if _creation_log is not None:
                _creation_log.append(msg)
        if _verbose:
            os.write(2, text or b"")

    _log_cb = _cb  # keep a reference: C holds the pointer
    L.llama_log_set(_cb, ctypes.c_void_p(0))
    L.llama_backend_init()
    _L = L
    return L


@contextmanager
def _logged() -> Iterator[list[str]]:
    """Every line llama.cpp logs inside the block (a model load, a context creation)."""
    global _creation_log
    lib()
    _creation_log = lines = []
    try:
        yield lines
    finally:
        _creation_log = None


def buffer_sizes(log: str, what: str = "model") -> dict[str, float]:
    """MiB per device of llama.cpp's ``<DEVICE> <what> buffer size = N MiB`` lines in a load
    or creation log (``what``: model, KV, compute): where the weights and the cache went."""
    out: dict[str, float] = {}
    for dev, mib in re.findall(rf"(\S+) {re.escape(what)} buffer size =\s*([0-9.]+) MiB", log):
        out[dev] = out.get(dev, 0.0) + float(mib)
    return out


def last_log_error() -> str:
    """The last error/warning llama.cpp logged, to enrich a one-line error message."""
    for line in reversed(_log_tail):
        # A failed load ends with "failed to load model"; the reason is the line before.
        if "error loading model:" in line:
            return line.split("error loading model:", 1)[1].strip()
    for line in reversed(_log_tail):
        if "error" in line.lower() or "failed" in line.lower():
            return line.strip()
    return _log_tail[-1].strip() if _log_tail else ""


@cache
def system_info() -> str:
    return lib().llama_print_system_info().decode()


def cpu_features() -> list[str]:
    """The CPU features the loaded ggml CPU backend was built for and uses (``AVX2``,
    ``F16C``, ``AVX512``, ``LLAMAFILE``, ...), from ``llama_print_system_info()``.
    ggml picks most CPU kernels at compile time, so this says which kernels run."""
    return re.findall(r"([A-Z0-9_]+) = 1", system_info())


def cpu_flag(name: str) -> bool:
    """True when the CPU advertises the /proc/cpuinfo flag ``name`` (False where there is no
    /proc/cpuinfo): what the CPU can run, whatever ggml was built for."""
    try:
        with open("/proc/cpuinfo") as f:
            return bool(re.search(rf"\b{re.escape(name)}\b", f.read()))
    except OSError:
        return False


def cpu_has_amx() -> bool:
    """True when the CPU advertises AMX-INT8 (Sapphire Rapids and later)."""
    return cpu_flag("amx_int8")


def lib_has_amx() -> bool:
    """True when the loaded ggml CPU backend was compiled with AMX kernels."""
    return "AMX_INT8 = 1" in system_info()


def use_extra_bufts(cpu_amx: bool | None = None, lib_amx: bool | None = None) -> bool:
    """Whether it is safe to enable ggml's extra CPU buffer types.

    With AMX compiled in and an AMX CPU, ggml routes quantised matmuls through
    the AMX buffer type, which segfaults on batches of ~21+ tokens with
    SmolLM2 Q4_1 (docs/design.md section 5). Extra buffer types only buy
    weight repacking speed, so they are turned off exactly in that case.
    Our own build compiles AMX out, so it keeps them.
    """
    if os.environ.get("EDGEKV_EXTRA_BUFTS") in ("0", "1"):
        return os.environ["EDGEKV_EXTRA_BUFTS"] == "1"
    cpu_amx = cpu_has_amx() if cpu_amx is None else cpu_amx
    lib_amx = lib_has_amx() if lib_amx is None else lib_amx
    return not (cpu_amx and lib_amx)


def cache_type_id(name: str) -> int:
    return type_by_name(name).id


class _Owned:
    """Frees its llama.cpp object when garbage-collected, if ``close`` was not called."""

    def close(self) -> None:
        raise NotImplementedError

    def __del__(self) -> None:  # pragma: no cover - GC timing
        try:
            self.close()
        except Exception:
            pass


@dataclass(frozen=True)
class Arch:
    """What the KV engine needs to know about a loaded model."""

    name: str
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd: int
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int
    n_swa: int
    rope_type: int
    is_recurrent: bool
    is_hybrid: bool


class Model(_Owned):
    """A loaded GGUF model (weights) plus its vocabulary."""

    def __init__(self, path: str | os.PathLike, *, n_gpu_layers: int | None = None, rpc: tuple[str, ...] = ()) -> None:
        """``rpc``: llama.cpp rpc-servers (``HOST:PORT``, checked by ``edgekv.rpc``) that hold
        the offloaded layers and their KV cache, instead of this machine's own GPUs.
        ``n_gpu_layers``: layers offloaded (negative: all); default all with ``rpc``, else 0."""
        from . import rpc as rpc_mod
        from .models import validate_gguf

        self.path = Path(path)
        self.rpc = tuple(rpc)
        self.n_gpu_layers = (-1 if self.rpc else 0) if n_gpu_layers is None else n_gpu_layers
        self.ptr = None
        validate_gguf(self.path)
        L = lib()
        params = L.llama_model_default_params()
        params.n_gpu_layers = self.n_gpu_layers
        params.use_extra_bufts = use_extra_bufts()
        devs = None
        if self.rpc:  # the servers' devices only, NULL-terminated; the global registry stays local
            found = rpc_mod.devices(self.rpc, self)
            devs = (ctypes.c_void_p * (len(found) + 1))(*found, None)
            params.devices = ctypes.cast(devs, ctypes.c_void_p)
        with _logged() as log:
            self.ptr = L.llama_model_load_from_file(str(self.path).encode(), params)
        self.load_log = "".join(log)
        if not self.ptr:
            rpc_mod.release(self.rpc, self)
            raise ModelError(f"llama.cpp could not load {self.path}: {last_log_error() or 'unknown error'}")
        self._owner: object | None = None  # None: this object loaded the weights and frees them
        self._setup()

    @classmethod
    def from_llama(cls, llm: object) -> Model:
        """The weights an existing ``llama_cpp.Llama`` has loaded, shared rather than loaded
        again. Only the model is reused: edgekv creates its own contexts, because the Llama's
        context has no query capture, no rotation record and its own token bookkeeping, which a
        compacted cache would contradict. The Llama stays the owner and must stay open."""
        ptr = getattr(llm, "model", None)
        path = getattr(llm, "model_path", None)
        if not ptr or not path:
            raise ModelError("expected an open llama_cpp.Llama (it has no loaded model)")
        self = cls.__new__(cls)
        lib()  # edgekv's log capture and backend initialisation
        self.path = Path(path)
        self.n_gpu_layers = int(getattr(getattr(llm, "model_params", None), "n_gpu_layers", 0) or 0)
        self.rpc = ()
        self.ptr = ptr
        self._owner = llm  # keeps the Llama, and so the weights, alive as long as this Model
        self._setup()
        return self

    def _setup(self) -> None:
        L = lib()
        self.vocab = L.llama_model_get_vocab(self.ptr)
        self.arch = self._read_arch()
        if self.arch.is_recurrent or self.arch.is_hybrid:
            raise ModelError(
                f"{self.path.name}: {self.arch.name} keeps recurrent state; edgekv compresses "
                "attention KV caches only (transformer models)"
            )
        if self.arch.rope_type in (8, 24, 40):  # M-RoPE / vision: cells carry 2D positions
            raise ModelError(f"{self.path.name}: M-RoPE ({self.arch.name}) KV caches are not supported yet")
        if self.info.mla:
            from .archs import MLA_REFUSAL

            raise ModelError(f"{self.path.name}: {self.arch.name}: {MLA_REFUSAL}")

    @cached_property
    def info(self) -> ModelInfo:
        """What the GGUF header says (per-layer heads, KV bytes per cell), read once per model."""
        from .gguf_info import read_model_info

        return read_model_info(self.path)

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(512)
        n = lib().llama_model_meta_val_str(self.ptr, key.encode(), buf, 512)
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def _read_arch(self) -> Arch:
        L = lib()
        m = self.ptr
        name = self.meta("general.architecture") or "?"
        n_head = L.llama_model_n_head(m)
        n_embd = L.llama_model_n_embd(m)
        hd_k = self.meta(f"{name}.attention.key_length")
        hd_v = self.meta(f"{name}.attention.value_length")
        head_dim = n_embd // max(n_head, 1)
        return Arch(
            name=name,
            n_layer=L.llama_model_n_layer(m),
            n_head=n_head,
            n_head_kv=L.llama_model_n_head_kv(m),
            n_embd=n_embd,
            head_dim_k=int(hd_k) if hd_k else head_dim,
            head_dim_v=int(hd_v) if hd_v else head_dim,
            n_ctx_train=L.llama_model_n_ctx_train(m),
            n_swa=L.llama_model_n_swa(m),
            rope_type=L.llama_model_rope_type(m),
            is_recurrent=bool(L.llama_model_is_recurrent(m)),
            is_hybrid=bool(L.llama_model_is_hybrid(m)),
        )

    # -- text ---------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        L = lib()
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int, *, special: bool = False) -> bytes:
        L = lib()
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        return bool(lib().llama_vocab_is_eog(self.vocab, token))

    @property
    def n_vocab(self) -> int:
        return lib().llama_vocab_n_tokens(self.vocab)

    def apply_chat_template(self, messages: list[dict[str, str]], add_assistant: bool = True) -> str:
        """Render messages with the GGUF's own chat template (llama.cpp's built-in engine)."""
        return render_chat(lib().llama_model_chat_template(self.ptr, None), messages, add_assistant)

    def close(self) -> None:
        if getattr(self, "ptr", None) and getattr(self, "_owner", None) is None:
            lib().llama_model_free(self.ptr)
            if getattr(self, "rpc", ()):
                from .rpc import release

                release(self.rpc, self)
        self.ptr = None
        self._owner = None


def render_chat(tmpl: bytes | None, messages: list[dict[str, str]], add_assistant: bool = True) -> str:
    """Render messages with a chat template: a GGUF's template text or the name of one
    of llama.cpp's built-in formats (``chat_template_names``). No template: a plain
    transcript, the honest fallback."""
    if not tmpl:
        out = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return out + ("assistant:" if add_assistant else "")
    L = lib()
    keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
    arr = (L.llama_chat_message * len(keep))()
    for i, (r, c) in enumerate(keep):
        arr[i].role = r
        arr[i].content = c
    cap = sum(len(c) for _, c in keep) * 2 + 1024
    buf = ctypes.create_string_buffer(cap)
    n = L.llama_chat_apply_template(tmpl, arr, len(keep), add_assistant, buf, cap)
    if n > cap:
        buf = ctypes.create_string_buffer(n)
        n = L.llama_chat_apply_template(tmpl, arr, len(keep), add_assistant, buf, n)
    if n < 0:
        raise ModelError("the model's chat template is not supported by llama.cpp's template engine")
    return buf.raw[:n].decode("utf-8", "replace")


def chat_template_names() -> list[str]:
    """The chat formats llama.cpp's template engine knows by name."""
    L = lib()
    n = L.llama_chat_builtin_templates(None, 0)
    out = (ctypes.c_char_p * n)()
    L.llama_chat_builtin_templates(out, n)
    return [x.decode() for x in out]


def _rotation_from_log(log: str) -> tuple[int, int]:
    """Hadamard block sizes llama.cpp uses for this context's K and V cache (0 = none).

    Since 2026 llama.cpp rotates each head of a *quantised* K/V cache by an
    orthonormal Walsh-Hadamard matrix (q and k alike, so attention is
    unchanged) to spread outliers before quantisation. Cached rows are then
    H·k, not k; scorers that look at channels (LagKV's per-channel min/max)
    must undo it. llama.cpp logs its decision; we read that rather than
    re-deriving the rule, and fall back to the rule if the log is silent.
    """
    mk = re.search(r"attn_rot_k = (\d+), n_embd_head_k_all = (-?\d+)", log)
    mv = re.search(r"attn_rot_v = (\d+)", log)
    if mk is None or mv is None:
        raise EdgekvError("could not tell from llama.cpp's log whether the KV cache is Hadamard-rotated")
    k_rot = 0
    if mk.group(1) == "1":
        head = int(mk.group(2))
        k_rot = 64
        while head % (k_rot * 2) == 0:
            k_rot *= 2
    v_rot = 64 if mv.group(1) == "1" else 0
    return k_rot, v_rot


UNQUANTISED_V = ("f16", "f32", "bf16")  # the V cache types llama.cpp can use without flash attention


def check_flash_attn(flash_attn: str, cache_type_v: str) -> None:
    """The one-line errors for a flash-attention setting llama.cpp cannot run."""
    if flash_attn not in FLASH_ATTN:
        raise EdgekvError(f"--flash-attn must be one of {', '.join(FLASH_ATTN)}, got {flash_attn!r}")
    if cache_type_v not in UNQUANTISED_V and flash_attn == "off":
        raise EdgekvError(f"a quantised V cache ({cache_type_v}) needs flash attention; use --flash-attn on or auto")


def resolve_flash_attn(flash_attn: str, cache_type_v: str, n_gpu_layers: int) -> str:
    """What ``auto`` means for edgekv: off for an unquantised V cache on the CPU.

    llama.cpp's own ``auto`` turns flash attention on wherever the backend has
    the op, the CPU included. On the CPU that makes decoding 2.4-3.5x slower
    for about the same prefill speed: measured here (SmolLM2-135M, f16 cache,
    2 threads, ``bench/flash_attention.py``) 22.1 vs 52.0 ms/token at 1k tokens of
    context and 35.4 vs 124.8 at 4k (``bench/RESULTS.md``). A quantised V
    cache needs flash attention, and on a GPU llama.cpp knows best, so those
    keep ``on``/``auto``.
    """
    if flash_attn != "auto":
        return flash_attn
    if cache_type_v not in UNQUANTISED_V:
        return "on"
    return "auto" if n_gpu_layers != 0 else "off"  # negative: every layer offloaded


class Context(_Owned):
    """A llama.cpp context (KV cache + compute) for one model, one sequence (seq 0)."""

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int,
        n_batch: int = 512,
        cache_type_k: str = "f16",
        cache_type_v: str = "f16",
        flash_attn: str = "auto",
        n_threads: int | None = None,
        n_seq_max: int = 1,
        capture: bool = True,
    ) -> None:
        L = lib()
        tk, tv = cache_type_id(cache_type_k), cache_type_id(cache_type_v)
        check_flash_attn(flash_attn, cache_type_v)
        if n_ctx < 16:
            raise EdgekvError(f"n_ctx={n_ctx} is too small (minimum 16)")
        requested = flash_attn
        flash_attn = resolve_flash_attn(flash_attn, cache_type_v, model.n_gpu_layers)
        self.model = model
        p = L.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = min(n_batch, n_ctx)
        p.n_ubatch = min(n_batch, n_ctx)
        p.n_seq_max = n_seq_max
        threads = n_threads or max(1, os.cpu_count() or 1)
        p.n_threads = threads
        p.n_threads_batch = threads
        p.type_k = tk
        p.type_v = tv
        p.flash_attn_type = FLASH_ATTN[flash_attn]
        p.no_perf = True
        # The eval callback can only be set now; an idle capture costs a name check per node.
        self.capture = Capture(model.arch.n_layer) if capture and capture_available() else None
        if self.capture is not None:
            self._cb_eval = L.ggml_backend_sched_eval_callback(self.capture.callback_address())
            p.cb_eval = self._cb_eval
            p.cb_eval_user_data = self.capture.user_data()
        with _logged() as log:
            self.ptr = L.llama_init_from_model(model.ptr, p)
        self.creation_log = created_log = "".join(log)
        if not self.ptr:
            raise EdgekvError(f"llama.cpp could not create a context: {last_log_error() or 'unknown error'}")
        self.mem = L.llama_get_memory(self.ptr)
        self.n_ctx = L.llama_n_ctx(self.ptr)
        self.n_batch = p.n_batch
        self.n_stream = 1 if p.kv_unified else n_seq_max  # KV streams: one per sequence unless unified
        self.n_ctx_seq = int(L.llama_n_ctx_seq(self.ptr))  # the cells one sequence can hold
        self.cache_type_k = cache_type_k
        self.cache_type_v = cache_type_v
        self.flash_attn = flash_attn  # as resolved; "auto" only where llama.cpp decides (GPU offload)
        self.flash_attn_requested = requested
        self._batch = L.llama_batch_init(self.n_batch, 0, 1)
        self.k_rot, self.v_rot = _rotation_from_log(created_log)

    # -- decoding -------------------------------------------------------------
    def decode(self, tokens: list[int], start_pos: int, *, all_logits: bool = False, seq: int = 0) -> None:
        """Decode ``tokens`` at positions start_pos.. (<= n_batch tokens); logits for the
        last token, or for every token with ``all_logits`` (``logits(i)``)."""
        self._live()
        L = lib()
        n = len(tokens)
        if n == 0 or n > self.n_batch:
            raise ValueError(f"decode takes 1..{self.n_batch} tokens, got {n}")
        b = self._batch
        b.n_tokens = n
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = start_pos + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = all_logits or i == n - 1
        rc = L.llama_decode(self.ptr, b)
        if rc != 0:
            raise EdgekvError(
                f"llama_decode failed (code {rc}, context of {self.n_ctx} cells): "
                f"{last_log_error() or 'no free slot in the KV cache'}"
            )

    def decode_each(self, items: list[tuple[int, int, int]]) -> None:
        """One ``llama_decode`` for tokens of several sequences, ``(token, position, seq)``
        each, with logits for every one (``logits(i)`` is the i-th item's): how a context
        holding several conversations advances them all in one step."""
        self._live()
        n = len(items)
        if n == 0 or n > self.n_batch:
            raise ValueError(f"decode_each takes 1..{self.n_batch} tokens, got {n}")
        b = self._batch
        b.n_tokens = n
        for i, (t, pos, seq) in enumerate(items):
            b.token[i] = t
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = True
        rc = lib().llama_decode(self.ptr, b)
        if rc != 0:
            raise EdgekvError(
                f"llama_decode failed (code {rc}, {n} sequences in a context of {self.n_ctx} cells): "
                f"{last_log_error() or 'no free slot in the KV cache'}"
            )

    def logits(self, i: int = -1) -> np.ndarray:
        self._live()
        L = lib()
        ptr = L.llama_get_logits_ith(self.ptr, i)
        if not ptr:
            raise EdgekvError("no logits available for that batch position")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy()

    # -- memory ---------------------------------------------------------------
    def pos_max(self, seq: int = 0) -> int:
        self._live()
        return lib().llama_memory_seq_pos_max(self.mem, seq)

    def clear(self) -> None:
        self._live()
        lib().llama_memory_clear(self.mem, True)

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        self._live()
        return bool(lib().llama_memory_seq_rm(self.mem, seq, p0, p1))

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        self._live()
        lib().llama_memory_seq_add(self.mem, seq, p0, p1, delta)

    def state_get(self, seq: int = 0) -> bytearray:
        """The sequence's state blob. llama.cpp writes straight into the returned
        buffer: a compaction round trip moves the whole cache, so copies count."""
        self._live()
        L = lib()
        size = L.llama_state_seq_get_size(self.ptr, seq)
        out = bytearray(size)
        n = L.llama_state_seq_get_data(self.ptr, (ctypes.c_uint8 * size).from_buffer(out), size, seq)
        if n != size:
            raise EdgekvError(f"llama_state_seq_get_data wrote {n} of {size} bytes")
        return out

    def state_set(self, blob: bytes | bytearray, seq: int = 0) -> None:
        self._live()
        L = lib()
        arr = ctypes.c_uint8 * len(blob)
        buf = arr.from_buffer(blob) if isinstance(blob, bytearray) else arr.from_buffer_copy(blob)
        n = L.llama_state_seq_set_data(self.ptr, buf, len(blob), seq)
        if n != len(blob):
            raise EdgekvError(
                f"llama.cpp rejected the sequence state ({n} of {len(blob)} bytes read): "
                f"{last_log_error() or 'layout mismatch'}"
            )

    def _live(self) -> None:
        # a call on a freed llama_context would crash the process
        if not self.ptr:
            raise EdgekvError("the llama.cpp context is closed")

    def close(self) -> None:
        L = lib()
        if getattr(self, "_batch", None) is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "ptr", None):
            L.llama_free(self.ptr)
            self.ptr = None


_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # llama_token_data


@dataclass(frozen=True)
class SamplerConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = 0


class Sampler(_Owned):
    """llama.cpp's sampler chain for one configuration: greedy at temperature 0,
    else top-k, top-p, min-p, temperature and a seeded draw."""

    def __init__(self, cfg: SamplerConfig) -> None:
        L = lib()
        self.cfg = cfg
        self.ptr = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if cfg.temperature <= 0:
            L.llama_sampler_chain_add(self.ptr, L.llama_sampler_init_greedy())
        else:
            L.llama_sampler_chain_add(self.ptr, L.llama_sampler_init_top_k(cfg.top_k))
            L.llama_sampler_chain_add(self.ptr, L.llama_sampler_init_top_p(cfg.top_p, 1))
            L.llama_sampler_chain_add(self.ptr, L.llama_sampler_init_min_p(cfg.min_p, 1))
            L.llama_sampler_chain_add(self.ptr, L.llama_sampler_init_temp(cfg.temperature))
            L.llama_sampler_chain_add(self.ptr, L.llama_sampler_init_dist(cfg.seed))

    def sample(self, ctx: Context) -> int:
        """The next token from the context's last logits."""
        ctx._live()
        return int(lib().llama_sampler_sample(self.ptr, ctx.ptr, -1))

    def sample_logits(self, logits: np.ndarray) -> int:
        """The next token from a copy of one row of logits, as ``sample`` draws it from the
        context's: the chain applied to every token's logit, then told what it chose. For a
        context shared by several conversations, whose output buffer holds only the last
        decode's rows."""
        L = lib()
        n = len(logits)
        cur = np.zeros(n, dtype=_TOKEN_DATA)
        cur["id"] = np.arange(n, dtype=np.int32)
        cur["logit"] = logits
        arr = L.llama_token_data_array(cur.ctypes.data_as(L.llama_token_data_p), n, -1, False)
        L.llama_sampler_apply(self.ptr, ctypes.byref(arr))
        if not 0 <= arr.selected < n:
            raise EdgekvError("the sampler chose no token")
        tok = int(ctypes.cast(arr.data, L.llama_token_data_p)[arr.selected].id)
        L.llama_sampler_accept(self.ptr, tok)
        return tok

    def close(self) -> None:
        if getattr(self, "ptr", None):
            lib().llama_sampler_free(self.ptr)
            self.ptr = None
