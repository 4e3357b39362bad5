"""Chelsea without the log-count bias: the same merges, but attention weighs a
merged cell as one token. It runs on the state engine (any stock libllama,
Gemma 3's iSWA cache), where attention cannot be biased per (layer, head, cell);
the benchmark sets it beside ``chelsea`` to show what the bias is worth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .chelsea import Chelsea


@dataclass
class ChelseaNoBias(Chelsea):
    """Chelsea's merges; merged cells count once in attention."""

    name = "chelsea_nobias"
    summary = "chelsea's merges without the log-count bias (any engine)"
    needs = frozenset({"merge"})
    bias: ClassVar[bool] = False
