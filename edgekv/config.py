"""Configuration, built once: how a context is made (``ContextOptions``) and how far each
compression brings its cache down (``BudgetRule``).

The CLI, the server and the benchmarks build both from one option set and hand them to
every ``Session`` they open; the session asks the rule for its targets and its prefill
chunk instead of working them out again. Budget conventions (the CLI documents the same):

- ``budget=N``: each compression brings the cache down to N cells. A cell is one cached
  token per (layer, KV head); memory is ``N x kv_bytes_per_cell``.
- ``ratio=R``: each compression *removes* a fraction R of the cells present (kvpress's
  ``compression_ratio``; R=0.75 keeps 25 %).
- neither: a compressing method halves the cache when it is full, like context shift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .errors import BudgetError
from .methods import Method, get_method

DEFAULT_CHUNK = 256  # tokens decoded per prefill batch
DEFAULT_INTERACTIVE_BUDGET = 1024  # chat and serve: what a compressing method keeps given no rule
DEFAULT_MAX_CTX = 4096  # the capacity given no budget: min(trained context, this)


@dataclass(frozen=True)
class ContextOptions:
    """How each llama.cpp context is made: cache types, flash attention, threads, the KV
    engine, and the prefill chunk (the batch a context is sized for)."""

    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str = "auto"
    n_threads: int | None = None
    engine: str = "auto"
    chunk: int = DEFAULT_CHUNK

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise BudgetError(f"chunk must be positive, got {self.chunk}")


@dataclass(frozen=True)
class BudgetRule:
    """A method and the rule it compresses under, in a context of ``capacity`` cells.

    Made by ``BudgetRule.make``, which applies the defaults once. ``method`` is a spec
    (``knorm``, ``knorm+rerotate@6144``) with ``params``, or a ready ``Method`` instance
    (the Python API); either way ``build`` gives the method to run, and checks the rule
    against it: every one-line error for a rule no session could keep, once per method
    built (one per session, or per server conversation)."""

    method: str | Method = "full"
    budget: int | None = None
    ratio: float | None = None
    params: tuple[tuple[str, object], ...] = ()
    capacity: int = DEFAULT_MAX_CTX

    @classmethod
    def make(cls, method: str | Method = "full", *, budget: int | None = None, ratio: float | None = None,
             params: dict[str, object] | None = None, n_ctx: int | None = None, chunk: int = DEFAULT_CHUNK,
             n_ctx_train: int | None = None, interactive: bool = False) -> BudgetRule:
        """The rule with its defaults: ``interactive`` (chat, serve) gives a compressing
        method named without a budget, ratio or capacity ``DEFAULT_INTERACTIVE_BUDGET``
        cells; the capacity is then ``budget + chunk`` (one prefill chunk of room after each
        compression), or ``min(n_ctx_train, DEFAULT_MAX_CTX)`` with no budget."""
        name = method.name if isinstance(method, Method) else method
        if interactive and budget is None and ratio is None and n_ctx is None and name != "full":
            budget = DEFAULT_INTERACTIVE_BUDGET
        if n_ctx is None:
            n_ctx = budget + chunk if budget is not None else min(n_ctx_train or DEFAULT_MAX_CTX, DEFAULT_MAX_CTX)
        return cls(method, budget, ratio, tuple(sorted((params or {}).items())), n_ctx)

    def but(self, method: str | Method | None = None, *, budget: int | None = None, ratio: float | None = None,
            params: dict[str, object] | None = None) -> BudgetRule:
        """The same capacity under another method or rule (a method given no budget or ratio
        keeps none: it halves when full, or ``full`` never compresses)."""
        return replace(self, method=self.method if method is None else method, budget=budget, ratio=ratio,
                       params=tuple(sorted((params or {}).items())))

    @property
    def method_name(self) -> str:
        return self.method.name if isinstance(self.method, Method) else self.method

    def build(self) -> Method:
        """The method to run under this rule, checked: the instance given, or a new one from
        the spec and params (one-line errors for unknown methods and bad parameters too)."""
        if isinstance(self.method, Method):
            if self.params:
                raise BudgetError("method parameters go with a method name, not a method instance")
            method = self.method
        else:
            method = get_method(self.method, **dict(self.params))
        self._check(method)
        return method

    def _check(self, method: Method) -> None:
        """The one-line errors for a rule this capacity and method cannot keep."""
        budget, ratio, capacity = self.budget, self.ratio, self.capacity
        if capacity < 1:
            raise BudgetError(f"--n-ctx must be a positive number of cells, got {capacity}")
        if budget is not None and ratio is not None:
            raise BudgetError("give either --budget or --ratio, not both")
        if ratio is not None and not 0.0 < ratio < 1.0:
            raise BudgetError(f"--ratio is the fraction removed and must be in (0, 1), got {ratio}")
        if budget is not None and budget < 1:
            raise BudgetError(f"--budget must be a positive number of cells, got {budget}")
        if budget is not None and budget >= capacity:
            raise BudgetError(f"--budget {budget} must be below --n-ctx {capacity} (room to decode after compressing)")
        if budget is not None and (why := method.budget_error(budget)):
            raise BudgetError(why)

    def target(self, cells: int) -> int:
        """Cells a compression of ``cells`` cells brings the cache down to."""
        if self.budget is not None:
            return self.budget
        if self.ratio is not None:
            return max(1, math.floor(cells * (1.0 - self.ratio)))
        return max(1, cells // 2)  # a method given without budget or ratio: halve, like context shift

    def chunk(self, method: Method, chunk: int) -> int:
        """Prefill chunk size: a compression must leave room for the next chunk. With a
        budget that is capacity - budget; otherwise at least the fraction a compression removes."""
        capacity = self.capacity
        if self.budget is not None:
            return min(chunk, capacity - self.budget)
        if self.ratio is not None:
            return max(1, min(chunk, math.floor(capacity * self.ratio)))
        if method.compresses:
            return max(1, min(chunk, capacity // 2))
        return min(chunk, capacity)


__all__ = ["BudgetRule", "ContextOptions", "DEFAULT_CHUNK", "DEFAULT_INTERACTIVE_BUDGET"]
