"""ggml's tensor types that llama.cpp allows for the KV cache: ids, names, block sizes.

The one place where a cache-type name (``--cache-type-k q8_0``) becomes a ggml
type id and a row length becomes bytes; ``llama.py`` (creating contexts) and
``kvcache/`` (parsing and converting rows) both read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import StateLayoutError


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type: ``block_size`` elements are stored in ``type_size`` bytes."""

    id: int
    name: str
    block_size: int
    type_size: int


GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_Q4_0 = 2
GGML_TYPE_Q4_1 = 3
GGML_TYPE_Q5_0 = 6
GGML_TYPE_Q5_1 = 7
GGML_TYPE_Q8_0 = 8
GGML_TYPE_IQ4_NL = 20
GGML_TYPE_BF16 = 30

#: The types llama.cpp allows for the KV cache, keyed by ggml enum value.
#: Sizes are those of ggml-common.h's block structs (checked against the library).
GGML_TYPES: dict[int, GGMLType] = {
    t.id: t
    for t in (
        GGMLType(GGML_TYPE_F32, "f32", 1, 4),
        GGMLType(GGML_TYPE_F16, "f16", 1, 2),
        GGMLType(GGML_TYPE_Q4_0, "q4_0", 32, 18),  # fp16 d, 16 nibble bytes
        GGMLType(GGML_TYPE_Q4_1, "q4_1", 32, 20),  # fp16 d, fp16 m, 16 nibble bytes
        GGMLType(GGML_TYPE_Q5_0, "q5_0", 32, 22),  # fp16 d, u32 high bits, 16 nibble bytes
        GGMLType(GGML_TYPE_Q5_1, "q5_1", 32, 24),  # fp16 d, fp16 m, u32 high bits, nibbles
        GGMLType(GGML_TYPE_Q8_0, "q8_0", 32, 34),  # fp16 d, 32 int8
        GGMLType(GGML_TYPE_IQ4_NL, "iq4_nl", 32, 18),  # fp16 d, 16 nibble bytes (codebook)
        GGMLType(GGML_TYPE_BF16, "bf16", 1, 2),
    )
}

_BY_NAME: dict[str, GGMLType] = {t.name: t for t in GGML_TYPES.values()}

def type_by_name(name: str) -> GGMLType:
    """Look up a type by llama.cpp's cache-type name (``--cache-type-k`` spelling)."""
    t = _BY_NAME.get(name.strip().lower()) if isinstance(name, str) else None
    if t is None:
        valid = ", ".join(_BY_NAME)
        raise StateLayoutError(f"unknown KV cache type {name!r}; valid names: {valid}")
    return t


def _get_type(type_id: int) -> GGMLType:
    t = GGML_TYPES.get(int(type_id))
    if t is None:
        valid = ", ".join(f"{t.id}={t.name}" for t in GGML_TYPES.values())
        raise StateLayoutError(f"unsupported ggml type id {type_id}; supported: {valid}")
    return t


def row_size(type_id: int, n: int) -> int:
    """Bytes that ``n`` elements of ``type_id`` occupy (ggml_row_size)."""
    t = _get_type(type_id)
    if n < 0 or n % t.block_size:
        raise StateLayoutError(f"{t.name} rows need a multiple of {t.block_size} elements, got {n}")
    return n // t.block_size * t.type_size


def kv_types(spec: str) -> tuple[str, str]:
    """(K, V) cache-type names from one benchmark cache type: ``q8_0`` for both halves, or
    ``q8_0/q4_0`` for K and V apart (llama.cpp's ``-ctk q8_0 -ctv q4_0``: keys are the
    half whose rounding moves attention, so users quantise them less)."""
    parts = spec.split("/") if isinstance(spec, str) else []
    if len(parts) not in (1, 2):
        raise StateLayoutError(f"a KV cache type is one type name or K/V (q8_0/q4_0), got {spec!r}")
    k, v = (type_by_name(t).name for t in (parts * 2)[:2])
    return k, v


def kv_kwargs(spec: str) -> dict[str, str]:
    """``Session``'s ``cache_type_k``/``cache_type_v`` for one benchmark cache type (``kv_types``)."""
    return dict(zip(("cache_type_k", "cache_type_v"), kv_types(spec), strict=True))
