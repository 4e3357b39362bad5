"""Byte-level mutations as replayable recipes, for the fuzzers in bench/ (GGUF headers,
state blobs): one home for what a mutation is and how it is applied.

A recipe is a JSON object: ``{"kind": "flip" | "bytes" | "field", "at": offset, "bytes": hex}``
(those bytes written at the offset), ``{"kind": "truncate", "size": n}`` or
``{"kind": "append", "bytes": hex}``; a failing one is committed as a seed and replayed.
"""

from __future__ import annotations

import random

# values a length, count, type or offset field is set to, by its width in bytes
EXTREMES = {1: [0, 1, 0x7F, 0xFF], 2: [0, 1, 0x7FFF, 0xFFFF], 4: [0, 1, 2**31 - 1, 2**31, 2**32 - 1],
            8: [0, 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1]}


def field_value(rng: random.Random, data: bytes, at: int, size: int) -> dict:
    """The field of ``size`` bytes at ``at`` set to an extreme or one off its value."""
    old = int.from_bytes(data[at : at + size], "little")
    value = rng.choice([*EXTREMES[size], old + 1, old - 1, old * 2]) % (1 << (8 * size))
    return {"kind": "field", "at": at, "bytes": value.to_bytes(size, "little").hex()}


def apply(data: bytes, m: dict) -> bytes:
    """``data`` with the recipe ``m`` applied."""
    if m["kind"] == "truncate":
        return data[: m["size"]]
    b = bytes.fromhex(m["bytes"])
    if m["kind"] == "append":
        return data + b
    return data[: m["at"]] + b + data[m["at"] + len(b) :]


__all__ = ["EXTREMES", "apply", "field_value"]
