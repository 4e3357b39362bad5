"""What every compression method shares: protection of sinks and recent tokens,
and the selection contract of the engines (same count per layer and KV head).

Two kinds of method, as in kvpress:

- a ``ScorerMethod`` only writes ``score`` (per layer: [KV heads, cells],
  higher keeps); the base owns the protected cells and the top-k;
- a ``Method`` that chooses indices itself overrides ``select`` (LagKV's
  partitions, llama.cpp's context shift).

``compress(engine, target, why=...)`` applies a method to a cache; a method
that changes positions instead of evicting (context shift) overrides it. It is
told why it runs (``Why``): the session's budget rule (a full cache, or the
rule's own target), the method's own schedule (it said so through ``due``), or
a caller's explicit target. A method is given the session's budget rule once,
by ``bind``; the rule asks it the smallest budget it can keep
(``budget_error``). Hyperparameters are dataclass fields with the papers'
defaults, so ``edgekv methods`` can list them and the CLI can set them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar, Literal, TypeVar

import numpy as np

from ..errors import BudgetError, EdgekvError
from ..gguf_info import ModelInfo
from ..kvcache.engine import KVEngine
from ..kvcache.snapshot import KVSnapshot


def score_threads() -> int:
    """Cores a ``parallel`` scorer spreads its layers over: ``SCORE_THREADS`` when set,
    else EDGEKV_SCORE_THREADS (1: in turn), else this process's cores, at most 4. Read at
    each compression, so a bad value is a one-line error there, not at import."""
    if SCORE_THREADS:
        return SCORE_THREADS
    given = os.environ.get("EDGEKV_SCORE_THREADS", "")
    if given:
        if not given.isdigit() or int(given) < 1:
            raise EdgekvError(f"EDGEKV_SCORE_THREADS must be a whole number >= 1, got {given!r}")
        return int(given)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(4, cores)


SCORE_THREADS: int | None = None  # None: score_threads() decides
T = TypeVar("T")

if TYPE_CHECKING:
    from ..config import BudgetRule

# Why a compression runs: "budget", the session's budget rule (a full cache, or the rule's
# target); "schedule", the method's own schedule (``due`` asked for it); "call", a caller's
# explicit target (``Session.compress(target)``, the benchmark protocol).
Why = Literal["budget", "schedule", "call"]


@dataclass
class Method:
    """Base class. ``sinks``: the first tokens of the sequence, always kept
    (attention sinks, StreamingLLM). ``window``: the newest cells, always kept
    (the local context a query-agnostic compression cannot judge yet)."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    compresses: ClassVar[bool] = True
    shifts_positions: ClassVar[bool] = False  # only llama.cpp's context shift
    # engine capabilities the method needs ("merge", "score", "read", "bias", "queries");
    # the Session refuses the method on an engine that lacks one
    needs: ClassVar[frozenset[str]] = frozenset()
    # the engine must tally the attention every cell receives from every later query (H2O)
    tallies: ClassVar[bool] = False
    # the engine must keep the statistics of every query before RoPE (Expected Attention)
    query_statistics: ClassVar[bool] = False

    sinks: int = 4
    window: int = 32

    def __post_init__(self) -> None:
        """Range checks every method shares; a subclass's own ``__post_init__`` calls this first."""
        for name in ("sinks", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")

    def bind(self, rule: BudgetRule) -> None:
        """Called once by the Session with its budget rule (already checked).

        Methods whose own hyperparameters express the budget (LagKV's per-
        partition keep ratio) or whose schedule follows it adopt it here; the
        default needs nothing.
        """

    def budget_error(self, budget: int) -> str | None:
        """Why ``--budget budget`` is too small for this method (None: it is not). Asked once,
        by the budget rule's check: every compressing method keeps its sinks and window."""
        if self.compresses and not self.shifts_positions and budget <= self.sinks + self.window:
            return (f"--budget {budget} leaves no room beyond the {self.sinks} sinks + "
                    f"{self.window}-token window that {self.name} always keeps")
        return None

    def refuse_below(self, target: int, need: int) -> None:
        """The one-line error for an explicit target below the ``need`` cells the method keeps."""
        if target < need:
            raise BudgetError(f"budget {target} is below the {need} cells {self.name} always keeps "
                              f"(sinks={self.sinks}, window={self.window})")

    def attach(self, info: ModelInfo) -> None:
        """Called by the Session with the model it runs: a method with per-model data
        (CompressKV's calibrated retrieval heads) loads and checks it here, and one with
        compiled kernels loads them (a first call in the middle of a reply would stall it)."""

    def due(self, tokens_since_compress: int, n_cells: int) -> bool:
        """Incremental methods: compress now, before the cache is full?

        Asked by the Session after every decoded chunk or token (unless it runs
        the method one-shot). True makes it compress with ``why="schedule"``;
        ``select`` may then keep everything (no event is recorded)."""
        return False

    @property
    def scratch_cells(self) -> int:
        """Cells the method needs beside the session's capacity while it compresses (KVzip's
        reconstruction pass); the Session allocates them with the context. 0: none."""
        return 0

    @property
    def queries_needed(self) -> int:
        """How many of the newest queries per layer the method reads (its observation
        window); the Session has the engine record them. 0: none."""
        return 0

    def params(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def protected(self, snap: KVSnapshot) -> np.ndarray:
        """bool [L, H, n]: cells that must survive any compression."""
        n = snap.n_cells
        prot = snap.token_pos < self.sinks
        prot[:, :, max(0, n - max(self.window, 1)) :] = True  # the newest cell always stays
        return prot

    def min_budget(self, snap: KVSnapshot) -> int:
        return int(self.protected(snap).sum(axis=2).max())

    def select(self, snap: KVSnapshot, budget: int, *, why: Why = "call") -> np.ndarray:
        """int [L, H, B]: cells to keep per (layer, KV head), ascending; B <= budget
        unless ``why`` is "schedule" (a step of the method's own schedule, see ``due``)."""
        raise NotImplementedError

    def snapshot(self, engine: KVEngine) -> KVSnapshot:
        """What ``select`` reads: the engine's snapshot, plus whatever the method computes
        from the engine itself first (KVzip's reconstruction pass)."""
        return engine.snapshot()

    def compress(self, engine: KVEngine, target: int, *, why: Why = "call") -> int:
        """One compression of the engine's cache towards ``target`` cells; returns
        how far positions moved (0: evicting methods keep every position)."""
        snap = self.snapshot(engine)
        keep = self.select(snap, target, why=why)
        if keep.shape[2] < snap.n_cells:
            engine.compact(keep)
        return 0


@dataclass
class ScorerMethod(Method):
    """A method that scores cells per (layer, KV head); the base keeps the top ``budget``."""

    # ``score`` is host arithmetic on what the snapshot hands out (its K/V, key norms,
    # window attention: the snapshot serialises its own calls into the engine), so the
    # base may score several layers at once, one per core. Kept sets do not change: each
    # layer's scores are the same floats whichever thread computes them.
    parallel: ClassVar[bool] = False

    def score(self, snap: KVSnapshot, layer: int) -> np.ndarray:
        """float [H, n] for one layer; higher means keep."""
        raise NotImplementedError

    def fetch(self, snap: KVSnapshot, layer: int) -> None:
        """Read what ``score`` reads from the engine for ``layer`` (K, V, window scores) before
        ``score`` runs: one engine call can then bring several layers, or every layer's window
        scores, at once. None: nothing."""

    def select(self, snap: KVSnapshot, budget: int, *, why: Why = "call") -> np.ndarray:
        n = snap.n_cells
        if budget >= n:
            return np.broadcast_to(np.arange(n), (snap.n_layer, snap.n_kv_head, n)).copy()
        prot = self.protected(snap)
        self.refuse_below(budget, int(prot.sum(axis=2).max()))
        keep = np.empty((snap.n_layer, snap.n_kv_head, budget), dtype=np.int64)

        def score(layer: int) -> np.ndarray:
            s = self.score(snap, layer)
            snap.release(layer)  # its K/V, if the scorer read them: the buffers serve the next layers
            return s

        for layer, s in map_layers(score, snap.n_layer, parallel=self.parallel,
                                   fetch=lambda layer: self.fetch(snap, layer)):
            s = np.asarray(s, dtype=np.float64)
            if s.shape != (snap.n_kv_head, n):
                raise ValueError(f"{self.name}.score returned {s.shape}, expected {(snap.n_kv_head, n)}")
            s = np.where(np.isnan(s), -np.inf, s)
            s = np.where(prot[layer], np.inf, s)
            keep[layer] = top_k(s, budget)
        return keep


def map_layers(fn: Callable[[int], T], n_layer: int, *, parallel: bool,
               fetch: Callable[[int], object] | None = None) -> Iterator[tuple[int, T]]:
    """(layer, fn(layer)) in layer order.

    With ``parallel``, ``score_threads()`` threads take the layers in order, each as soon
    as it is free: ``fetch(layer)`` (the engine reads, which the snapshot serialises), then
    ``fn(layer)``, numpy's BLAS held to one thread each. Layers differ in cost (ProtoKV's
    first layers take twice its last), and threads that waited for each other at every
    pair of layers lost a few percent of the compression (bench/RESULTS.md, "Layers as
    threads free up"). At most ``AHEAD`` layers per thread are started beyond the
    one the caller waits for, so that finished layers do not pile up behind a slow one.
    ``fn`` must read the engine only through the snapshot. An error in one layer reaches
    the caller as it is, once the layers in flight have finished; no other layer starts."""
    threads = score_threads() if parallel else 1
    if threads < 2 or n_layer < 2:
        for layer in range(n_layer):
            if fetch is not None:
                fetch(layer)
            yield layer, fn(layer)
        return
    from threadpoolctl import threadpool_limits

    def job(layer: int) -> T:
        if fetch is not None:
            fetch(layer)
        return fn(layer)

    with threadpool_limits(limits=1, user_api="blas"):
        pool = ThreadPoolExecutor(threads)
        try:
            jobs: dict[int, Future[T]] = {}
            for layer in range(n_layer):
                for ahead in range(layer + len(jobs), min(n_layer, layer + AHEAD * threads + 1)):
                    jobs[ahead] = pool.submit(job, ahead)
                yield layer, jobs.pop(layer).result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


AHEAD = 2  # layers a scoring thread may start beyond the one the caller waits for


def top_k(s: np.ndarray, k: int) -> np.ndarray:
    """int [rows, k]: per row, the indices of the k highest scores, ascending.

    Ties at the cut go to the earlier index, so results are reproducible: the cells a
    stable argsort of ``-s`` would keep, found by a partition in O(n) rather than a
    sort (2.7 to 4.6 times faster at 1-2k cells, and it runs once per layer)."""
    n = s.shape[1]
    cut = np.partition(s, n - k, axis=1)[:, n - k : n - k + 1]  # the k-th highest score per row
    above = s > cut
    tied = s == cut
    room = k - above.sum(axis=1, keepdims=True)  # how many tied cells still fit, earliest first
    take = above | (tied & (np.cumsum(tied, axis=1) <= room))
    return np.nonzero(take)[1].reshape(-1, k)
