"""The evaluation protocol every benchmark shares: prefill once, then per method
restore, compress once, measure.

A context is prefilled into a full cache and saved; each (method, ratio) then
restores that state, switches the session to the method one-shot (its own
schedule, LagKV's incremental steps, is not asked: the cache is compressed
once, after the context) and compresses to its target. The question or the
continuation comes after, on the compressed cache: query-agnostic, as in a chat.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..methods import Method


@dataclass
class Prefill:
    """A prefilled context: the saved session state, its cells, the time it took."""

    saved: tuple
    n_cells: int
    seconds: float


def prefill(sess, tokens: list[int], progress=None) -> Prefill:
    """Empty the session, decode ``tokens`` (its cache must hold them) and save."""
    sess.reset()
    t0 = time.perf_counter()
    sess.feed(tokens, progress)
    seconds = time.perf_counter() - t0
    return Prefill(sess.save(), sess.engine.n_cells, seconds)


def compress_once(sess, pre: Prefill, method: str | Method, *, ratio: float = 0.0,
                  target: int | None = None, scheduled: bool = False) -> float:
    """Restore the prefill, use ``method`` under ``ratio``, compress once to ``target``
    (default: the ratio's); returns the compression's seconds (0 when nothing is removed)."""
    sess.restore(pre.saved)
    sess.use(method, ratio=ratio if ratio > 0 else None, scheduled=scheduled)
    if target is None:
        target = sess.rule.target(pre.n_cells) if ratio > 0 else pre.n_cells
    if target >= pre.n_cells:
        return 0.0
    t0 = time.perf_counter()
    sess.compress(target)
    return time.perf_counter() - t0
