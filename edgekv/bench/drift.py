"""Whether a long run's memory stays flat: samples against steps (turns or tokens), the
fitted slope over the run after its warm-up, a verdict, and a plot.

Flat means: after the warm-up, the least-squares slope of the resident set (RSS, less
tracemalloc's own tables) and of the Python heap (the bytes ``tracemalloc`` traces) is
below ``limit_pct`` of the warm RSS per 1000 steps. The warm-up is the first 10 % of
the run, or longer while the cache is still filling: the memory a run touches grows with
its cells until they reach their bound (llama.cpp's compute buffer is reserved for a full
cache, its pages touched as attention spans more cells), so the warm-up lasts until the
cells first reach 95 % of their most. What a run keeps by design counts (a chat's
transcript grows by its text), so a leak of a cell's worth per turn shows. A run too
short to judge (fewer than ``min_steps`` steps, 8 samples, or a cache that filled only
in the second half) says so instead of passing, and one whose heap was not traced fails.
"""

from __future__ import annotations

import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .speed import proc_status


def python_heap_mib() -> float | None:
    """MiB the Python allocator holds for objects made since tracing started (None: not
    traced; ``PYTHONTRACEMALLOC=1`` or ``tracemalloc.start()`` turns it on)."""
    return tracemalloc.get_traced_memory()[0] / 2**20 if tracemalloc.is_tracing() else None


def process_rss_mib() -> float:
    """This process's RSS less the memory tracemalloc's own tables take: tracing the heap
    keeps a record per live allocation, which would otherwise read as the run's growth."""
    own = tracemalloc.get_tracemalloc_memory() / 2**20 if tracemalloc.is_tracing() else 0.0
    return proc_status("VmRSS") - own


@dataclass
class Drift:
    """Samples of (step, RSS MiB, Python heap MiB, cells) over one run."""

    unit: str = "turn"
    limit_pct: float = 1.0
    min_steps: int = 200
    samples: list[tuple[int, float, float, int]] = field(default_factory=list)

    def add(self, step: int, cells: int, rss_mib: float | None = None, heap_mib: float | None = None) -> None:
        """A sample of this process (or the given RSS and heap, another process's: its RSS
        less what tracemalloc's own tables take, as ``process_rss_mib`` reads it)."""
        heap = python_heap_mib() if heap_mib is None else heap_mib
        self.samples.append((step, process_rss_mib() if rss_mib is None else rss_mib,
                             float("nan") if heap is None else heap, cells))

    def warm_step(self) -> int:
        """The step the warm-up ends at: 10 % of the run, or when the cells first reach
        95 % of their most, whichever is later."""
        steps = max(s[0] for s in self.samples)
        top = max(s[3] for s in self.samples)
        filled = next(s[0] for s in self.samples if s[3] >= 0.95 * top)
        return max(int(np.ceil(0.1 * steps)), filled)

    def _slope(self, col: int) -> tuple[float, float]:
        """(slope per 1000 steps, warm value) over the run after its warm-up."""
        a = np.array([(s[0], s[col]) for s in self.samples], dtype=np.float64)
        tail = a[a[:, 0] >= self.warm_step()]
        slope = np.polyfit(tail[:, 0], tail[:, 1], 1)[0] * 1000 if len(tail) >= 2 else float("nan")
        return float(slope), float(tail[0, 1])

    def verdict(self) -> dict[str, object]:
        steps = max((s[0] for s in self.samples), default=0)
        out: dict[str, object] = {"unit": self.unit, "steps": steps, "samples": len(self.samples),
                                  "limit_pct_per_1000": self.limit_pct,
                                  "max_cells": max((s[3] for s in self.samples), default=0)}
        warm_rss = self._slope(1)[1] if len(self.samples) >= 2 else float("nan")
        for name, col in (("rss_mib", 1), ("heap_mib", 2)):
            slope, warm = self._slope(col) if len(self.samples) >= 2 else (float("nan"), float("nan"))
            out[name] = {"warm": round(warm, 2), "end": round(float(self.samples[-1][col]), 2) if self.samples else None,
                         "slope_per_1000": round(slope, 3),
                         "slope_pct_of_warm_rss_per_1000": round(100 * slope / warm_rss, 3)}
        out["warm_step"] = self.warm_step() if self.samples else 0
        if steps < self.min_steps or len(self.samples) < 8:
            out["flat"] = None  # too short to judge
            out["why"] = f"{steps} {self.unit}s, {len(self.samples)} samples: too short to judge flatness"
        elif out["warm_step"] > steps / 2:
            out["flat"] = None
            out["why"] = (f"the cells filled only at {self.unit} {out['warm_step']} of {steps}: "
                          f"too short to judge flatness after the warm-up")
        elif np.isnan(out["heap_mib"]["slope_per_1000"]):
            out["flat"], out["why"] = False, "the Python heap was not traced (tracemalloc)"
        else:
            bad = [n for n in ("rss_mib", "heap_mib")
                   if not abs(out[n]["slope_pct_of_warm_rss_per_1000"]) < self.limit_pct]
            out["flat"] = not bad
            out["why"] = ("flat" if not bad else "growing: " + ", ".join(
                f"{n} {out[n]['slope_pct_of_warm_rss_per_1000']:+.2f} % of the warm RSS per 1000 {self.unit}s"
                for n in bad))
        return out

    def series(self) -> list[list[float]]:
        return [[s[0], round(s[1], 2), round(s[2], 3), s[3]] for s in self.samples]

    def plot(self, path: str | Path, title: str) -> Path:
        """Cells, RSS and the Python heap against steps, one panel each."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        a = np.array([s for s in self.samples], dtype=np.float64)
        fig, axes = plt.subplots(3, 1, figsize=(7, 6.5), sharex=True)
        for ax, col, label in zip(axes, (3, 1, 2), ("cells", "RSS (MiB)", "Python heap (MiB, traced)"), strict=True):
            ax.plot(a[:, 0], a[:, col], lw=1)
            ax.axvline(self.warm_step(), color="grey", ls=":", lw=1)  # the slope is fitted right of it
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[-1].set_xlabel(self.unit + "s")
        v = self.verdict()
        fig.suptitle(f"{title}\n{v['why']}", fontsize=9)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


__all__ = ["Drift", "process_rss_mib", "python_heap_mib"]
