"""``NAME+SUFFIX``: a method wrapped by another that changes one thing about it (kvpress's
``KeyRerotationPress``, ``ChunkKVPress``); everything else is the wrapped method's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ..errors import EdgekvError
from ..gguf_info import ModelInfo
from ..kvcache.engine import KVEngine
from ..kvcache.snapshot import KVSnapshot
from .base import Method, Why

if TYPE_CHECKING:
    from ..config import BudgetRule


@dataclass
class MethodWrapper(Method):
    """Answers as the wrapped ``method`` does; a subclass overrides what it changes."""

    suffix: ClassVar[str] = ""  # NAME+suffix
    arg: ClassVar[str] = ""  # the field NAME+suffix@N sets
    about: ClassVar[str] = ""  # what ``edgekv methods`` says of NAME+suffix

    method: Method | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        # (a default only because the base's fields have defaults; a method is required)
        if not isinstance(self.method, Method):
            raise EdgekvError(f"{type(self).__name__} wraps a method instance, e.g. "
                              f"{type(self).__name__}(method=get_method('knorm'))")
        # what the Session's budget checks read: the wrapped method's
        self.sinks, self.window = self.method.sinks, self.method.window

    @property
    def name(self) -> str:  # type: ignore[override]
        value = getattr(self, self.arg) if self.arg else 0
        return f"{self.method.name}+{self.suffix}" + (f"@{value}" if value else "")

    @property
    def summary(self) -> str:  # type: ignore[override]
        return self.method.summary

    @property
    def compresses(self) -> bool:  # type: ignore[override]
        return self.method.compresses

    @property
    def shifts_positions(self) -> bool:  # type: ignore[override]
        return self.method.shifts_positions

    @property
    def needs(self) -> frozenset[str]:  # type: ignore[override]
        return self.method.needs

    @property
    def tallies(self) -> bool:  # type: ignore[override]
        return self.method.tallies

    @property
    def query_statistics(self) -> bool:  # type: ignore[override]
        return self.method.query_statistics

    @property
    def queries_needed(self) -> int:
        return self.method.queries_needed

    @property
    def scratch_cells(self) -> int:
        return self.method.scratch_cells

    def params(self) -> dict[str, object]:
        return {**self.method.params(), self.suffix: True,
                **({f"{self.suffix}_{self.arg}": getattr(self, self.arg)} if self.arg else {})}

    def bind(self, rule: BudgetRule) -> None:
        self.method.bind(rule)

    def budget_error(self, budget: int) -> str | None:
        return self.method.budget_error(budget)

    def attach(self, info: ModelInfo) -> None:
        self.method.attach(info)

    def due(self, tokens_since_compress: int, n_cells: int) -> bool:
        return self.method.due(tokens_since_compress, n_cells)

    def protected(self, snap: KVSnapshot) -> np.ndarray:
        return self.method.protected(snap)

    def min_budget(self, snap: KVSnapshot) -> int:
        return self.method.min_budget(snap)

    def snapshot(self, engine: KVEngine) -> KVSnapshot:
        return self.method.snapshot(engine)

    def select(self, snap: KVSnapshot, budget: int, *, why: Why = "call") -> np.ndarray:
        return self.method.select(snap, budget, why=why)

    def compress(self, engine: KVEngine, target: int, *, why: Why = "call") -> int:
        return self.method.compress(engine, target, why=why)
