"""What a GGUF file says about its model, read from the header alone.

``edgekv info``, the KV budget maths and ``validate_gguf`` all need the same
few facts (layers, KV heads, head sizes, trained context, sliding-window
layout) before llama.cpp is ever asked to load the weights.

Why not ``gguf.GGUFReader``: it eagerly wraps every metadata element in numpy
views, so a header with a 150k-entry tokenizer takes 4-15 s to open. That is
far too slow for ``edgekv info`` or for validating a file before every load.
This module walks the same on-disk format (value types, ggml block sizes,
file-type names and key names all come from the ``gguf`` package) with
``struct`` over an ``mmap``, skipping large arrays instead of materialising
them: the whole header, tensor table included, parses in well under a second
and no tensor data is touched. ``tests/test_gguf_info.py`` cross-checks the
result against ``GGUFReader`` on a real model.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .errors import EdgekvError, ModelError
from .ggml_types import GGML_TYPES, GGMLType, row_size, type_by_name

# Arrays up to this many elements are decoded (per-layer arrays, small lists);
# longer ones (tokenizer vocab, merges, scores) are only skipped over.
_MAX_DECODED_ARRAY = 4096

# Sanity bounds: a corrupt header must not make us loop for hours.
_MAX_COUNT = 1 << 24
_MAX_DIMS = 8

_SCALAR_FMT: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}

# llama.cpp's default sliding-window pattern per architecture, used when the
# GGUF has a sliding window but no ``<arch>.attention.sliding_window_pattern``
# key. Source: the ``load_swa_pattern(ml, n_pattern, dense_first)`` calls in
# vendor/llama.cpp/src/models/*.cpp of llama-cpp-python 0.3.36 and
# ``llama_hparams::set_swa_pattern``. Value: (n_pattern, dense_first).
_DEFAULT_SWA_PATTERN: dict[str, tuple[int, bool]] = {
    "gemma2": (2, False),
    "gemma3": (6, False),  # 5 local layers then 1 global: global = 5, 11, 17, ...
    "gemma3n": (5, False),
    "gemma-embedding": (6, False),
    "cohere2": (4, False),
    "gpt-oss": (2, False),
    "exaone4": (4, False),
    "olmo2": (4, False),
    "llama4": (4, False),  # chunked attention on 3 layers of 4, full on the 4th
}

# gemma2 models always use a sliding window; llama.cpp assumes 4096 when the
# GGUF omits the key (vendor/llama.cpp/src/models/gemma2.cpp). Llama 4 attends in
# chunks of 8192 tokens on its chunked layers unless the key is 0 (llama4.cpp); to the
# cache that is a second, small cache as for a window, so edgekv treats it alike.
_DEFAULT_SLIDING_WINDOW: dict[str, int] = {"gemma2": 4096, "llama4": 8192}

# Cache types llama.cpp accepts for --cache-type-k / --cache-type-v (common/arg.cpp
# kv_cache_types), with their ids and byte sizes: one table, in ggml_types.
KV_CACHE_TYPES: dict[str, GGMLType] = {t.name: t for t in GGML_TYPES.values()}


@dataclass(frozen=True)
class LargeArray:
    """Placeholder for a metadata array too long to be worth decoding."""

    elem_type: GGUFValueType
    count: int


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the GGUF tensor table (``shape`` in ggml order, ne0 first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int  # relative to GGUFHeader.data_offset

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        return self.n_elements // block * size


@dataclass(frozen=True)
class GGUFHeader:
    """Everything in a GGUF file except the tensor data itself."""

    path: Path
    file_size: int
    version: int
    byte_order: str  # "<" or ">"
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_offset: int

    @property
    def data_end(self) -> int:
        """Bytes the file must have to hold every tensor the header declares."""
        end = max((t.offset + t.n_bytes for t in self.tensors), default=0)
        return self.data_offset + end


class _Cursor:
    """Bounds-checked little/big-endian reader over a memory map."""

    def __init__(self, buf: mmap.mmap | bytes, byte_order: str = "<") -> None:
        self.buf = buf
        self.pos = 0
        self.bo = byte_order

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Truncated(what, self.pos + n)

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (v,) = struct.unpack_from(self.bo + fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return bytes(raw).decode("utf-8", errors="replace")

    def skip_string(self, what: str) -> None:
        n = self.scalar("Q", what)
        self.need(n, what)
        self.pos += n


class _Truncated(Exception):
    def __init__(self, what: str, needed: int) -> None:
        super().__init__(what)
        self.what = what
        self.needed = needed


class _Corrupt(Exception):
    pass


def _value_type(raw: int, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise _Corrupt(f"unknown metadata value type {raw} for key {key!r}") from None


def _read_value(cur: _Cursor, vtype: GGUFValueType, key: str) -> Any:
    if vtype == GGUFValueType.STRING:
        return cur.string(key)
    if vtype == GGUFValueType.ARRAY:
        etype = _value_type(cur.scalar("I", key), key)
        count = cur.scalar("Q", key)
        if count > (1 << 40):
            raise _Corrupt(f"array {key!r} claims {count} elements")
        if etype == GGUFValueType.ARRAY:
            if count > _MAX_DECODED_ARRAY:
                raise _Corrupt(f"nested array {key!r} with {count} elements")
            return [_read_value(cur, etype, key) for _ in range(count)]
        if etype == GGUFValueType.STRING:
            if key == VOCAB_KEY:
                return _vocabulary(cur, count)
            if count > _MAX_DECODED_ARRAY:
                for _ in range(count):
                    cur.skip_string(key)
                return LargeArray(etype, count)
            return [cur.string(key) for _ in range(count)]
        fmt = _SCALAR_FMT[etype]
        size = struct.calcsize(fmt)
        cur.need(size * count, key)
        if count > _MAX_DECODED_ARRAY:
            cur.pos += size * count
            return LargeArray(etype, count)
        vals = list(struct.unpack_from(f"{cur.bo}{count}{fmt}", cur.buf, cur.pos))
        cur.pos += size * count
        return vals
    return cur.scalar(_SCALAR_FMT[vtype], key)


VOCAB_KEY = "tokenizer.ggml.tokens"


def _vocabulary(cur: _Cursor, count: int) -> list[str] | LargeArray:
    """The token strings, checked as llama.cpp needs them: it maps every string to its id
    and aborts the process (GGML_ASSERT in llama-vocab.cpp) when two ids share a string
    (empty ones it renames first). Decoded only when short, as other string arrays."""
    seen: dict[bytes, int] = {}
    out: list[str] = []
    for i in range(count):
        n = cur.scalar("Q", VOCAB_KEY)
        cur.need(n, VOCAB_KEY)
        raw = bytes(cur.buf[cur.pos : cur.pos + n])
        cur.pos += n
        if raw and seen.setdefault(raw, i) != i:
            raise _Corrupt(f"its vocabulary lists the token {raw.decode('utf-8', 'replace')!r} twice (ids "
                           f"{seen[raw]} and {i}), which llama.cpp cannot load")
        if count <= _MAX_DECODED_ARRAY:
            out.append(raw.decode("utf-8", errors="replace"))
    return out if count <= _MAX_DECODED_ARRAY else LargeArray(GGUFValueType.STRING, count)


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse a GGUF header and tensor table; ModelError (one line) if it is not sound.

    Checks magic, version, that every metadata item and tensor entry lies
    inside the file, that tensor types are known, and that the file is long
    enough for all the tensor data the header declares -- a truncated
    download fails here instead of deep inside llama.cpp.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        raise ModelError(f"model file {p} does not exist") from None
    if p.is_dir():
        raise ModelError(f"{p} is a directory, not a GGUF model file")
    if size == 0:
        raise ModelError(f"{p} is empty (0 bytes), not a GGUF model file")
    try:
        with open(p, "rb") as f:
            head = f.read(8)
            if head[:4] != b"GGUF":
                raise ModelError(f"{p} is not a GGUF file: it starts with {head!r}, expected b'GGUF'")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return _parse(p, mm, size)
    except PermissionError:
        raise ModelError(f"cannot read {p}: permission denied") from None
    except IsADirectoryError:
        raise ModelError(f"{p} is a directory, not a GGUF model file") from None


def _parse(p: Path, mm: mmap.mmap, size: int) -> GGUFHeader:
    cur = _Cursor(mm)
    cur.pos = 4
    try:
        version = cur.scalar("I", "version")
        if version & 0xFFFF == 0 and version != 0:  # written big-endian
            cur.bo = ">"
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in (2, 3):
            raise ModelError(
                f"{p}: unsupported GGUF version {version} (llama.cpp reads versions 2 and 3)"
            )
        n_tensors = cur.scalar("Q", "tensor count")
        n_kv = cur.scalar("Q", "metadata count")
        if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
            raise _Corrupt(f"header claims {n_tensors} tensors and {n_kv} metadata items")

        meta: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = _value_type(cur.scalar("I", key), key)
            meta[key] = _read_value(cur, vtype, key)

        tensors: list[TensorInfo] = []
        for i in range(n_tensors):
            name = cur.string(f"tensor #{i} name")
            n_dims = cur.scalar("I", name)
            if n_dims > _MAX_DIMS:
                raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
            shape = tuple(cur.scalar("Q", name) for _ in range(n_dims))
            raw_type = cur.scalar("I", name)
            offset = cur.scalar("Q", name)
            try:
                gtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise _Corrupt(f"tensor {name!r} has unknown ggml type {raw_type}") from None
            if gtype not in GGML_QUANT_SIZES:
                raise _Corrupt(f"tensor {name!r} has unsupported ggml type {gtype.name}")
            tensors.append(TensorInfo(name, shape, gtype, offset))
    except _Truncated as e:
        raise ModelError(
            f"{p} is truncated or corrupt: its header runs past the end of the file "
            f"(reading {e.what} needs {e.needed} bytes, file has {size})"
        ) from None
    except _Corrupt as e:
        raise ModelError(f"{p} is corrupt: {e}") from None

    alignment = meta.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ModelError(f"{p} is corrupt: bad general.alignment {alignment!r}")
    data_offset = -(-cur.pos // alignment) * alignment
    header = GGUFHeader(
        path=p,
        file_size=size,
        version=version,
        byte_order=cur.bo,
        metadata=meta,
        tensors=tuple(tensors),
        alignment=alignment,
        data_offset=data_offset,
    )
    if header.data_end > size:
        raise ModelError(
            f"{p} is truncated or corrupt: header declares {header.data_end} bytes of tensor data "
            f"and file has {size} ({100 * size / header.data_end:.1f}%); re-download it"
        )
    return header


@dataclass(frozen=True)
class ModelInfo:
    """The model facts edgekv needs, as the GGUF metadata states them.

    Head counts and head sizes are also given per layer because some
    architectures vary them (per-layer ``head_count_kv`` arrays, separate
    head sizes on sliding-window layers); the scalar fields are the values of
    a full-attention layer (``n_head_kv`` is the largest per-layer value).
    """

    path: Path
    file_size: int
    gguf_version: int
    arch: str
    name: str
    file_type: str  # e.g. "Q4_K_M"; from general.file_type, else the dominant tensor type
    n_params: int
    n_tensors: int
    tensor_types: dict[str, int]
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_head_kv_layers: tuple[int, ...]
    head_dim_k: int
    head_dim_v: int
    head_dim_k_swa: int
    head_dim_v_swa: int
    n_ctx_train: int
    sliding_window: int  # 0 when the model has no sliding-window attention
    swa_layers: tuple[bool, ...] = field(default=())
    swa_pattern_source: str = "none"  # "gguf", "llama.cpp default (period N)", "none"
    # the factor llama.cpp's attention multiplies q.k by (not always 1/sqrt(head_dim_k))
    kq_scale: float = 0.0
    attn_logit_softcap: float = 0.0  # Gemma 2's tanh soft-capping of the logits; 0: none
    positions: str = "rope"  # how attention knows positions: "rope", "learned" (embeddings) or "alibi"
    max_alibi_bias: float = 0.0  # ALiBi's bias, which sets each head's slope (ggml's soft_max); 0: no ALiBi
    kv_lora_rank: int = 0  # DeepSeek-V2 style low-rank KV: the latent's width; 0: none
    mla: bool = False  # llama.cpp caches that latent itself, one per layer, V a view of K (MLA)
    recurrent: bool = False  # keeps recurrent state (SSM, RWKV, short convolutions), alone or beside attention
    nope_layers: tuple[int, ...] = ()  # layers whose keys llama.cpp does not rotate (SmolLM3, Llama 4)
    attn_sinks: bool = False  # learned per-head sink logits in every softmax (gpt-oss)
    mrope: bool = False  # multimodal RoPE: positions in sections (Qwen2-VL and its kin)

    @property
    def is_swa_model(self) -> bool:
        return self.sliding_window > 0 and any(self.swa_layers)

    def is_swa(self, il: int) -> bool:
        return bool(self.swa_layers[il]) if self.swa_layers else False

    def head_dims(self, il: int) -> tuple[int, int]:
        """(K, V) head size of layer ``il``: SWA layers may use their own sizes."""
        if self.is_swa(il):
            return self.head_dim_k_swa, self.head_dim_v_swa
        return self.head_dim_k, self.head_dim_v

    @property
    def global_layers(self) -> tuple[int, ...]:
        return tuple(il for il in range(self.n_layer) if not self.is_swa(il))


def _scalar_or_layers(v: Any, n_layer: int, key: str, p: Path) -> tuple[int, ...]:
    """llama.cpp's get_key_or_arr: a scalar applies to every layer, an array is per layer."""
    if isinstance(v, list):
        if len(v) != n_layer:
            raise ModelError(f"{p}: {key} has {len(v)} entries for {n_layer} layers")
        return tuple(int(x) for x in v)
    return (int(v),) * n_layer


def read_model_info(path: str | os.PathLike[str]) -> ModelInfo:
    """Read ModelInfo from a GGUF file's header (ModelError if it is unusable)."""
    h = read_gguf_header(path)
    m = h.metadata
    p = h.path
    arch = m.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelError(f"{p}: GGUF has no general.architecture; not a llama.cpp model file")

    def key(k: str, default: Any = None) -> Any:
        return m.get(f"{arch}.{k}", default)

    n_layer = key("block_count")
    n_embd = key("embedding_length")
    if not isinstance(n_layer, int) or not isinstance(n_embd, int):
        raise ModelError(f"{p}: {arch} GGUF lacks {arch}.block_count / {arch}.embedding_length")
    n_head_layers = _scalar_or_layers(key("attention.head_count", 0), n_layer, "head_count", p)
    n_head = n_head_layers[0] if n_head_layers else 0
    # n_head_kv defaults to n_head (llama-model.cpp load_hparams).
    kv_raw = key("attention.head_count_kv")
    n_head_kv_layers = (
        n_head_layers
        if kv_raw is None
        else _scalar_or_layers(kv_raw, n_layer, "head_count_kv", p)
    )
    default_hd = n_embd // n_head if n_head else 0
    head_dim_k = int(key("attention.key_length", default_hd))
    head_dim_v = int(key("attention.value_length", default_hd))
    head_dim_k_swa = int(key("attention.key_length_swa", head_dim_k))
    head_dim_v_swa = int(key("attention.value_length_swa", head_dim_v))

    sliding_window = int(key("attention.sliding_window", _DEFAULT_SLIDING_WINDOW.get(arch, 0)))
    if arch == "llama4" and sliding_window:  # llama.cpp chunks by 8192 whatever the key says, unless it is 0
        sliding_window = _DEFAULT_SLIDING_WINDOW[arch]
    swa_layers: tuple[bool, ...] = (False,) * n_layer
    source = "none"
    if sliding_window > 0:
        pattern = key("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            if len(pattern) != n_layer:
                raise ModelError(
                    f"{p}: sliding_window_pattern has {len(pattern)} entries for {n_layer} layers"
                )
            swa_layers = tuple(bool(x) for x in pattern)
            source = "gguf"
        else:
            if isinstance(pattern, int):
                n_pattern, dense_first, source = pattern, False, "gguf"
            elif arch in _DEFAULT_SWA_PATTERN:
                n_pattern, dense_first = _DEFAULT_SWA_PATTERN[arch]
                source = f"llama.cpp default (period {n_pattern})"
            else:
                # A window without a known layout: llama.cpp's set_swa_pattern(0)
                # semantics would make every layer SWA; say so rather than guess.
                n_pattern, dense_first = 0, False
                source = "assumed all layers (no pattern in GGUF)"
            swa_layers = _swa_pattern(n_layer, n_pattern, dense_first)
        if not any(swa_layers):
            sliding_window = 0
            source = "none"

    types = Counter(t.ggml_type.name for t in h.tensors)
    ft = m.get("general.file_type")
    file_type = _file_type_name(ft) if isinstance(ft, int) else None
    if file_type is None:
        file_type = types.most_common(1)[0][0] if types else "?"

    alibi = _max_alibi_bias(arch, key("attention.max_alibi_bias", 0.0), n_layer)
    return ModelInfo(
        path=p,
        file_size=h.file_size,
        gguf_version=h.version,
        arch=arch,
        name=str(m.get("general.name") or p.stem),
        file_type=file_type,
        n_params=sum(t.n_elements for t in h.tensors),
        n_tensors=len(h.tensors),
        tensor_types=dict(types.most_common()),
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=max(n_head_kv_layers, default=0),
        n_head_kv_layers=n_head_kv_layers,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        head_dim_k_swa=head_dim_k_swa,
        head_dim_v_swa=head_dim_v_swa,
        n_ctx_train=int(key("context_length", 0)),
        sliding_window=sliding_window,
        swa_layers=swa_layers,
        swa_pattern_source=source,
        kq_scale=_kq_scale(arch, key("attention.scale"), n_layer, n_embd, n_head, head_dim_k),
        attn_logit_softcap=float(key("attn_logit_softcapping", 0.0) or 0.0),
        positions="alibi" if alibi else "learned" if arch in _LEARNED_POS_ARCHS else "rope",
        max_alibi_bias=alibi,
        kv_lora_rank=int(key("attention.kv_lora_rank", 0) or 0),
        mla=bool(key("attention.key_length_mla", 0) and key("attention.value_length_mla", 0)),
        recurrent=any(k.startswith(tuple(f"{arch}.{g}" for g in _RECURRENT_KEYS)) for k in m),
        nope_layers=_nope_layers(arch, n_layer, key("attention.sliding_window")),
        attn_sinks=any(t.name.endswith(".attn_sinks.weight") for t in h.tensors),
        mrope=key("rope.dimension_sections") is not None,
    )


def _nope_layers(arch: str, n_layer: int, sliding_window: Any) -> tuple[int, ...]:
    """The layers ``arch``'s graph builds without RoPE: every ``step``-th one (llama.cpp's
    ``n_no_rope_layer_step``, src/models/smollm3.cpp and llama4.cpp; Llama 4 without chunked
    attention sets the step to the layer count, which leaves its last layer unrotated)."""
    step = 4 if arch == "smollm3" else 0
    if arch == "llama4":
        step = n_layer if sliding_window == 0 else 4
    return tuple(il for il in range(n_layer) if step and (il + 1) % step == 0)


# Architectures whose attention adds ALiBi's linear bias instead of rotating q and k
# (llama.cpp sets f_max_alibi_bias in their load_arch_hparams, src/models/*.cpp; MPT and
# JAIS read it from the GGUF, Baichuan uses it on its 40-layer 13B only), and those
# that add learned absolute position embeddings to the input.
_ALIBI_ARCHS = {"bloom": 0, "refact": 0, "baichuan": 40}
_LEARNED_POS_ARCHS = ("gpt2", "starcoder", "mpt")
# metadata groups of the recurrent blocks llama.cpp keeps state for (Mamba, RWKV, LFM2, ...)
_RECURRENT_KEYS = ("ssm.", "wkv.", "shortconv.", "time_mix_extra_dim")


def _max_alibi_bias(arch: str, from_gguf: Any, n_layer: int) -> float:
    """The ALiBi bias llama.cpp gives ``arch`` (0: none): fixed at 8 in its source for some
    architectures, read from the GGUF for the others."""
    if arch in _ALIBI_ARCHS and _ALIBI_ARCHS[arch] in (0, n_layer):
        return 8.0
    return float(from_gguf) if isinstance(from_gguf, (int, float)) and from_gguf > 0 else 0.0


def _kq_scale(arch: str, gguf_scale: Any, n_layer: int, n_embd: int, n_head: int, head_dim_k: int) -> float:
    """The factor llama.cpp's attention applies to q.k, for the queries edgekv captures
    (the graph's last tensor named ``Qcur-<layer>``; src/models/*.cpp).

    Gemma 3 27B (62 layers) scales by 1/sqrt(n_embd / n_head) instead of the head
    size; the Granite family reads ``attention.scale`` from the GGUF (other
    architectures ignore the key, so edgekv does too). Phi-3 scales its queries by
    1/sqrt(head size) before attention and names the scaled tensor ``Qcur`` again,
    so the captured queries need no further scale (``tests/test_archs.py`` checks
    every family's attention against a reference with this scale).
    """
    if arch == "phi3":
        return 1.0
    if arch == "gemma3" and n_layer == 62 and n_head:
        return 1.0 / math.sqrt(n_embd / n_head)
    if arch.startswith("granite") and isinstance(gguf_scale, (int, float)) and gguf_scale:
        return float(gguf_scale)
    return 1.0 / math.sqrt(head_dim_k) if head_dim_k else 0.0


def _swa_pattern(n_layer: int, n_pattern: int, dense_first: bool) -> tuple[bool, ...]:
    """Port of llama_hparams::set_swa_pattern (llama-hparams.cpp)."""
    if dense_first:
        return tuple(n_pattern == 0 or il % n_pattern != 0 for il in range(n_layer))
    return tuple(n_pattern == 0 or il % n_pattern < n_pattern - 1 for il in range(n_layer))


def _file_type_name(ft: int) -> str | None:
    try:
        name = gguf.LlamaFileType(ft).name
    except ValueError:
        return None
    for prefix in ("MOSTLY_", "ALL_"):
        name = name.removeprefix(prefix)
    return name


def _cache_type(name: str) -> GGMLType:
    return type_by_name(name)


def _row_bytes(t: GGMLType, n: int, what: str) -> int:
    """ggml_row_size: quantised rows must be a whole number of blocks."""
    if n % t.block_size:
        raise EdgekvError(f"{t.name} cache needs {what} rows in multiples of {t.block_size}; this model has {n}")
    return row_size(t.id, n)


def _layer_row_bytes(info: ModelInfo, il: int, k: GGMLType, v: GGMLType) -> int:
    hk, hv = info.head_dims(il)
    nkv = info.n_head_kv_layers[il]
    if nkv == 0:
        return 0
    return _row_bytes(k, nkv * hk, "K") + _row_bytes(v, nkv * hv, "V")


def kv_bytes_per_token(info: ModelInfo, cache_type_k: str = "f16", cache_type_v: str = "f16") -> int:
    """Bytes one token occupies in the KV cache, summed over all layers.

    Per layer, K holds n_head_kv*head_dim_k elements and V n_head_kv*head_dim_v,
    stored as ggml rows of the cache type (e.g. q8_0 = 34 bytes per 32).
    Sliding-window layers count too: this is the cost of one cache cell, which
    is what compression frees.
    """
    k, v = _cache_type(cache_type_k), _cache_type(cache_type_v)
    return sum(_layer_row_bytes(info, il, k, v) for il in range(info.n_layer))


def kv_cache_bytes(
    info: ModelInfo,
    n_ctx: int,
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    *,
    n_ubatch: int = 512,
    swa_full: bool = False,
) -> int:
    """Bytes llama.cpp allocates for a single-sequence KV cache of ``n_ctx`` cells.

    Full-attention layers hold ``n_ctx`` cells; with the iSWA cache, SWA layers
    hold only ``pad256(min(n_ctx, sliding_window + n_ubatch))`` cells
    (llama-kv-cache-iswa.cpp) unless ``swa_full``.
    """
    k, v = _cache_type(cache_type_k), _cache_type(cache_type_v)
    swa_cells = n_ctx
    if info.is_swa_model and not swa_full:
        swa_cells = -(-min(n_ctx, info.sliding_window + n_ubatch) // 256) * 256
    total = 0
    for il in range(info.n_layer):
        cells = swa_cells if info.is_swa(il) else n_ctx
        total += cells * _layer_row_bytes(info, il, k, v)
    return total


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _fmt_count(n: int) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{suffix}"
    return str(n)


def _kv_cell(fn: Any) -> str:
    try:
        return str(fn())
    except EdgekvError:
        return "n/a"


def format_info(info: ModelInfo) -> str:
    """Human-readable block for ``edgekv info``."""
    if len(set(info.n_head_kv_layers)) > 1:
        kv_heads = f"{min(info.n_head_kv_layers)}-{info.n_head_kv} KV heads (per layer)"
    else:
        kv_heads = f"{info.n_head_kv} KV heads"
    hd = f"head_dim k/v {info.head_dim_k}/{info.head_dim_v}"
    if (info.head_dim_k_swa, info.head_dim_v_swa) != (info.head_dim_k, info.head_dim_v):
        hd += f" (SWA layers {info.head_dim_k_swa}/{info.head_dim_v_swa})"
    if info.is_swa_model:
        glob = ", ".join(str(i) for i in info.global_layers) or "none"
        n_swa = sum(info.swa_layers)
        attn = (
            f"sliding window {info.sliding_window} on {n_swa} of {info.n_layer} layers, "
            f"global layers: {glob} [{info.swa_pattern_source}]"
        )
    else:
        attn = "full attention on all layers"
    types = ", ".join(f"{t} x{n}" for t, n in info.tensor_types.items())
    lines = [
        f"model       {info.name}",
        f"file        {info.path} ({_fmt_bytes(info.file_size)}, GGUF v{info.gguf_version})",
        f"arch        {info.arch}, {_fmt_count(info.n_params)} params, {info.file_type}",
        f"tensors     {info.n_tensors} ({types})",
        f"layers      {info.n_layer} (n_embd {info.n_embd}, {info.n_head} heads, {kv_heads}, {hd})",
        f"attention   {attn}",
        f"n_ctx_train {info.n_ctx_train}",
    ]
    per_tok = []
    at_ctx = []
    for ct in ("f16", "q8_0", "q4_0"):
        b = _kv_cell(lambda ct=ct: kv_bytes_per_token(info, ct, ct))
        per_tok.append(f"{ct} {b} B" if b != "n/a" else f"{ct} n/a")
        try:
            full = kv_cache_bytes(info, info.n_ctx_train, ct, ct, swa_full=True)
            s = f"{ct} {full / 2**20:.1f}"
            if info.is_swa_model:
                s += f" ({kv_cache_bytes(info, info.n_ctx_train, ct, ct) / 2**20:.1f} iSWA)"
            at_ctx.append(s)
        except EdgekvError:
            at_ctx.append(f"{ct} n/a")
    lines.append(f"KV/token    {', '.join(per_tok)}")
    lines.append(f"KV MiB @{info.n_ctx_train}  {', '.join(at_ctx)}")
    return "\n".join(lines)
