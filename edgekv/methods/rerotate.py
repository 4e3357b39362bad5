"""``NAME+rerotate``: a method whose cells are renumbered 0..n-1 after each compression
(``NAME+rerotate@N``: only once the next position has reached N)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import EdgekvError
from ..gguf_info import ModelInfo
from ..kvcache.engine import KVEngine
from ..kvcache.rope import Rope
from .base import Why
from .wrapper import MethodWrapper


@dataclass
class KeyRerotation(MethodWrapper):
    """Wraps a method (as kvpress's ``KeyRerotationPress`` does): after each compression
    that evicts, the cells get the positions 0..n-1 and every (layer, KV head)'s keys
    are re-rotated to them (``engine.renumber``), so each head sees what it kept as
    one contiguous run and the next token comes at position n.

    Without it a session keeps original positions: relative distances stay exact,
    but a 32k-token document through a 2k cache asks the model about distances up to
    32k, past a small model's trained context. With it, every distance stays below
    the cache size, at the price of telling the model evicted tokens never were.
    Models whose RoPE the host cannot reproduce are refused by name: sliding-window
    models when the session starts, YaRN or frequency factors before the first eviction.

    ``limit`` (``NAME+rerotate@N``) renumbers only at compressions where the next
    position has reached N, so positions stay below N plus the room between two
    compressions: every distance stays exact until then, and the re-rotation (a
    state round trip, several times the cost of a compression) runs once per
    N - n tokens of text instead of at every compression. 0 (the default)
    renumbers after every compression that evicts, as kvpress does."""

    suffix = "rerotate"
    arg = "limit"
    about = ("NAME, then the cells renumbered 0..n-1 after each compression, every head's keys "
             "re-rotated to match (for documents past the trained context); NAME+rerotate@N: "
             "only at compressions where the next position has reached N")

    limit: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.method.shifts_positions:
            raise EdgekvError(f"{self.method.name} already moves positions itself; it takes no re-rotation")
        if not isinstance(self.limit, int) or isinstance(self.limit, bool) or self.limit < 0:
            raise EdgekvError(f"the re-rotation limit must be a position >= 0 (NAME+rerotate@N), got {self.limit!r}")

    @property
    def summary(self) -> str:  # type: ignore[override]
        when = f"whenever the next position has reached {self.limit}" if self.limit else "after each compression"
        return f"{self.method.summary}; positions renumbered 0..n-1 {when}"

    def params(self) -> dict[str, object]:
        return {**self.method.params(), "rerotate": True, **({"rerotate_limit": self.limit} if self.limit else {})}

    def attach(self, info: ModelInfo) -> None:
        if info.positions != "rope":  # learned or ALiBi positions: keys carry no rotation
            raise EdgekvError(f"re-rotating keys is not supported for {info.arch} (no RoPE: its positions are "
                              f"{'ALiBi biases' if info.positions == 'alibi' else 'learned embeddings'}); "
                              "run without position re-indexing")
        if info.is_swa_model:  # the rest of what Rope.of refuses is checked at the first compression
            raise EdgekvError(f"re-rotating keys is not supported for {info.arch} (sliding-window layers: "
                              "two caches, two RoPE bases); run without position re-indexing")
        self.method.attach(info)

    def compress(self, engine: KVEngine, target: int, *, why: Why = "call") -> int:
        Rope.of(engine.ctx.model)  # a model it cannot re-rotate is refused before anything is evicted
        before = engine.n_cells
        moved = self.method.compress(engine, target, why=why)
        if engine.n_cells >= before or engine.ctx.pos_max() + 1 < self.limit:
            return moved
        return moved + engine.renumber()
