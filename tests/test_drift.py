"""The long runs' memory verdict (edgekv.bench.drift) on made-up series: a run that is
flat once its cache is full passes, a steady creep fails, and a run whose cache filled
late or that is too short says it cannot judge."""

from __future__ import annotations

import numpy as np

from edgekv.bench.drift import Drift


def _run(steps: int, fill_until: int, creep_mib_per_1000: float, every: int = 10) -> Drift:
    """RSS rising by 40 MiB while the cells fill, then creeping; the heap a tenth of that."""
    d = Drift(unit="turn")
    rng = np.random.default_rng(0)
    for t in range(every, steps + 1, every):
        full = min(t / fill_until, 1.0)
        rss = 400 + 40 * full + creep_mib_per_1000 * max(0, t - fill_until) / 1000 + rng.normal(0, 0.05)
        d.add(t, int(300 * full), rss_mib=rss, heap_mib=rss / 10)
    return d


def test_a_run_flat_once_its_cache_filled_passes_though_it_filled_after_the_first_tenth() -> None:
    d = _run(1000, fill_until=400, creep_mib_per_1000=0.0)
    v = d.verdict()
    assert v["warm_step"] == 380 and v["flat"] is True, v  # the cells first reach 95 % of 300 at turn 380
    # judged over the last 90 % instead, the filling reads as growth
    a = np.array([(s[0], s[1]) for s in d.samples])
    tail = a[a[:, 0] >= 100]
    assert np.polyfit(tail[:, 0], tail[:, 1], 1)[0] * 1000 / 440 * 100 > 1.0


def test_a_creep_after_the_warm_up_fails() -> None:
    v = _run(1000, fill_until=50, creep_mib_per_1000=6.0).verdict()  # 6 MiB per 1000 turns of ~440
    assert v["warm_step"] == 100 and v["flat"] is False and "rss_mib" in v["why"], v
    assert 1.2 < v["rss_mib"]["slope_pct_of_warm_rss_per_1000"] < 1.5


def test_a_late_fill_or_a_short_run_is_not_judged() -> None:
    late = _run(1000, fill_until=700, creep_mib_per_1000=0.0).verdict()
    assert late["flat"] is None and "filled only at turn 670" in late["why"], late
    short = _run(150, fill_until=10, creep_mib_per_1000=0.0).verdict()
    assert short["flat"] is None and "too short" in short["why"]
