"""One parametrised matrix every registered method passes, plus each baseline
against a direct implementation of its rule."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from edgekv.errors import BudgetError, EdgekvError
from edgekv.kvcache.cells import check_keep
from edgekv.kvcache.queries import QueryMoments, QueryWindow
from edgekv.kvcache.rope import ROPE_NEOX, Rope
from edgekv.kvcache.snapshot import KVSnapshot
from edgekv.methods import METHODS, base
from edgekv.methods import get_method as _get_method
from edgekv.methods.base import top_k
from edgekv.profiles import HeadProfile

L, H, N, D = 3, 2, 200, 16
# merging methods (Chelsea) do not select cells: tests/test_chelsea.py holds their contract
SELECTING = [n for n, c in METHODS.items() if "merge" not in c.needs]


def get_method(name: str, **params):
    """A configured method; CompressKV gets a synthetic retrieval-head profile (a
    Session attaches the calibrated one of its model)."""
    m = _get_method(name, **params)
    if name == "compresskv":
        rng = np.random.default_rng(9)
        m._profile = HeadProfile("synthetic", "0", list(range(L)), rng.random((L, 2 * H)).tolist(), 1, 1)
    return m


def snapshot(seed: int = 0, n: int = N, token_pos: np.ndarray | None = None) -> KVSnapshot:
    rng = np.random.default_rng(seed)
    keys = [rng.standard_normal((n, H, D)).astype(np.float32) * rng.uniform(0.5, 2, (n, H, 1))
            for _ in range(L)]
    values = [rng.standard_normal((n, H, D)).astype(np.float32) for _ in range(L)]
    # an observation window for the attention methods: 64 queries (2 per KV head) at the end
    q = rng.standard_normal((L, 2 * H, 64, D)).astype(np.float32)
    win = QueryWindow(64, tuple(range(L)), q, np.arange(n - 64, n, dtype=np.int32))
    tally = rng.exponential(1.0, (L, H, n))  # H2O's accumulated attention
    rebuilt = rng.random((L, H, n))  # KVzip's reconstruction scores
    moments = QueryMoments.zeros(Rope(ROPE_NEOX, D, 10000.0, 1.0), tuple(range(L)), frozenset(), 2 * H, D)
    moments.add(q, np.arange(n - 64, n), np.arange(n - 64, n))  # Expected Attention's statistics
    return KVSnapshot.from_arrays(keys, values, token_pos, queries=win, tally=tally, reconstruction=rebuilt,
                                  moments=moments)


@pytest.mark.parametrize("name", SELECTING)
@pytest.mark.parametrize("budget", [80, 120, 199])
def test_selection_contract(name: str, budget: int) -> None:
    """Valid indices for the engines, protected cells kept, reproducible."""
    m = get_method(name)
    snap = snapshot()
    keep = m.select(snap, budget)
    expect = N if not m.compresses else budget
    if m.shifts_positions:  # llama.cpp context shift halves, whatever the budget
        expect = N - m.n_discard(N)
    assert keep.shape == (L, H, expect)
    check_keep(keep, L, H, N)  # raises on any contract violation
    prot = m.protected(snap)
    for il in range(L):
        for h in range(H):
            assert set(np.flatnonzero(prot[il, h])) <= set(keep[il, h].tolist())
    assert np.array_equal(keep, m.select(snapshot(), budget))


@pytest.mark.parametrize("name", [n for n in SELECTING if not METHODS[n].shifts_positions])
def test_budget_at_or_above_cells_keeps_everything(name: str) -> None:
    keep = get_method(name).select(snapshot(n=50), 50)
    assert np.array_equal(keep, np.broadcast_to(np.arange(50), (L, H, 50)))


@pytest.mark.parametrize("name", [n for n in SELECTING if METHODS[n].compresses and not METHODS[n].shifts_positions])
def test_budget_below_protected_is_a_clear_error(name: str) -> None:
    m = get_method(name)
    with pytest.raises(BudgetError, match="always keeps"):
        m.select(snapshot(), m.sinks + m.window - 1)


@pytest.mark.parametrize("name", [n for n in SELECTING if METHODS[n].compresses])
def test_sinks_follow_token_positions_after_compaction(name: str) -> None:
    """Second compression: sinks are found by original token position, not cell index."""
    tp = np.broadcast_to(np.arange(N, dtype=np.int32) * 3, (L, H, N)).copy()
    m = get_method(name)
    keep = m.select(snapshot(token_pos=tp), 80)
    n_sink_cells = int((tp[0, 0] < m.sinks).sum())
    assert np.all(keep[:, :, :n_sink_cells] == np.arange(n_sink_cells))


PARALLEL = [n for n, c in METHODS.items() if getattr(c, "parallel", False)]


@pytest.mark.parametrize("name", PARALLEL)
def test_layers_scored_side_by_side_keep_what_one_thread_keeps(name: str, monkeypatch) -> None:
    """A ``parallel`` scorer scores several layers at once: the same cells, layer by layer."""
    assert {"expected_attention", "protokv"} <= set(PARALLEL)
    m = get_method(name)
    kept = {}
    for threads in (1, 3):
        monkeypatch.setattr(base, "SCORE_THREADS", threads)
        kept[threads] = m.select(snapshot(seed=4), N // 2)
    assert np.array_equal(kept[1], kept[3])


def test_layers_side_by_side_read_first_and_fail_with_their_own_error(monkeypatch) -> None:
    """Each layer's reads (``fetch``) run before its scoring, in the thread that scores it;
    a thread goes on while another is slow, no more than ``AHEAD`` layers per thread beyond
    the one the caller waits for; an error in one layer's scoring reaches the caller as it
    is, and no later layer starts."""
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    gate = threading.Event()

    class Failing(base.ScorerMethod):
        name = "failing"
        parallel = True

        def fetch(self, snap: KVSnapshot, layer: int) -> None:
            with lock:
                events.append(("fetch", layer))

        def score(self, snap: KVSnapshot, layer: int) -> np.ndarray:
            with lock:
                assert ("fetch", layer) in events, f"layer {layer} scored before its reads"
                events.append(("score", layer))
            if layer == 0:  # a slow first layer: the other thread goes on, as far as the window
                gate.wait(5)
                with lock:
                    at_first.extend(started())
            if layer == 3:
                raise EdgekvError("layer 3 cannot be scored")
            if layer == 2 * base.AHEAD:
                gate.set()
            return np.zeros((snap.n_kv_head, snap.n_cells))

    def started() -> list[int]:
        return [layer for kind, layer in events if kind == "fetch"]

    at_first: list[int] = []
    monkeypatch.setattr(base, "SCORE_THREADS", 2)
    snap = snapshot()
    snap.token_pos = np.broadcast_to(np.arange(N), (12, H, N)).copy()  # 12 layers to score
    with pytest.raises(EdgekvError, match="layer 3 cannot be scored"):
        Failing(sinks=0, window=1).select(snap, N // 2)
    assert at_first == list(range(2 * base.AHEAD + 1))  # layer 0 held the caller: no layer past the window
    assert sorted(started()) == list(range(len(started())))  # each once, from the first on
    # the caller waited for layer 3 with at most the window's layers beyond it submitted
    assert 3 + 1 < len(started()) <= 3 + 2 * base.AHEAD + 1
    assert sorted(layer for kind, layer in events if kind == "score") == started()


def test_knorm_keeps_lowest_key_norms_per_head() -> None:
    m = get_method("knorm", sinks=0, window=1)
    snap = snapshot(3)
    keep = m.select(snap, 50)
    for il in range(L):
        for h in range(H):
            norms = np.linalg.norm(snap.keys(il)[:, h], axis=1)
            ref = np.argsort(norms[:-1], kind="stable")[:49]
            assert np.array_equal(keep[il, h], np.sort(np.append(ref, N - 1)))
    assert not np.array_equal(keep[0, 0], keep[0, 1])  # heads choose independently


def test_top_k_keeps_what_a_stable_sort_keeps() -> None:
    # the base's top-k is a partition; ties (few distinct scores), protected (+inf) and
    # NaN-replaced (-inf) cells must land exactly where a stable argsort puts them
    rng = np.random.default_rng(11)
    for _ in range(500):
        rows, n = int(rng.integers(1, 5)), int(rng.integers(1, 300))
        k = int(rng.integers(1, n + 1))
        s = rng.integers(0, 6, size=(rows, n)).astype(np.float64)
        s[rng.random((rows, n)) < 0.1] = np.inf
        s[rng.random((rows, n)) < 0.1] = -np.inf
        ref = np.sort(np.argsort(-s, axis=1, kind="stable")[:, :k], axis=1)
        assert np.array_equal(top_k(s, k), ref)


def test_streaming_llm_is_sinks_plus_recent() -> None:
    m = get_method("streaming_llm", sinks=4, window=8)
    keep = m.select(snapshot(), 40)
    ref = np.concatenate([np.arange(4), np.arange(N - 36, N)])
    assert np.all(keep == ref)


def test_random_differs_by_seed_and_head() -> None:
    a = get_method("random", seed=0).select(snapshot(), 100)
    b = get_method("random", seed=1).select(snapshot(), 100)
    assert not np.array_equal(a, b)
    assert not np.array_equal(a[0, 0], a[0, 1])


def test_unknown_method_and_parameter() -> None:
    with pytest.raises(EdgekvError, match="unknown method 'nope'; available: full"):
        get_method("nope")
    with pytest.raises(EdgekvError, match="has no parameter 'bogus'"):
        get_method("knorm", bogus=1)


def test_parameters_in_the_name() -> None:
    """``name:k=v:...`` configures as keyword arguments do (a sweep's method list names
    configurations this way); keywords given beside it win; bad ones are one-line errors."""
    assert get_method("chunkkv:per_layer=true:chunk=20:window=64") == get_method(
        "chunkkv", per_layer=True, chunk=20, window=64)
    assert get_method("chunkkv:chunk=20", chunk=8).chunk == 8
    wrapped = get_method("knorm:sinks=8+chunk@16")
    assert (wrapped.method.sinks, wrapped.chunk) == (8, 16)
    # a '+' inside a value (an exponent) is the value's, not a wrapper's
    assert get_method("expected_attention:epsilon=1e+3").epsilon == 1000.0
    assert get_method("expected_attention:epsilon=1e+3+rerotate").method.epsilon == 1000.0
    for bad, why in (("chunkkv:chunk", "NAME=VALUE"), ("chunkkv:", "NAME=VALUE"), ("chunkkv:=3", "NAME=VALUE"),
                     ("chunkkv:bogus=1", "has no parameter 'bogus'"), ("chunkkv:chunk=x", "takes int values"),
                     ("nope:a=1", "unknown method 'nope'"), ("knorm+bogus", "unknown method suffix 'bogus'")):
        with pytest.raises(EdgekvError, match=why):
            get_method(bad)


@pytest.mark.parametrize(("name", "params"), [("snapkv", {"window": 0}), ("snapkv", {"kernel": 4}),
                                              ("chunkkv", {"chunk": 0}), ("chunkkv", {"window": 0}),
                                              ("compresskv", {"heads": 0}), ("h2o", {"recent": 1.0})])
def test_bad_attention_parameters_are_clear_errors(name: str, params: dict) -> None:
    with pytest.raises(EdgekvError, match="bad parameters"):
        _get_method(name, **params)


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize(("param", "value"), [("sinks", -3), ("window", -1)])
def test_negative_sinks_and_window_are_one_line_errors_for_every_method(name: str, param: str, value: int) -> None:
    with pytest.raises(EdgekvError, match=f"{param} must be a whole number >= 0") as e:
        _get_method(name, **{param: value})
    assert "\n" not in str(e.value)
    with pytest.raises(EdgekvError, match="sinks must be"):  # a wrapper passes them to the method it wraps
        _get_method(f"{name}+rerotate", sinks=-1)


def test_chunk_means_follow_their_definition() -> None:
    from edgekv.methods.chunk import chunk_means

    rng = np.random.default_rng(4)
    s = rng.standard_normal((3, 23))
    s[0, :2] = np.inf  # kept regardless
    s[1, 5] = np.nan
    s[2, 8:16] = np.inf  # a run with nothing scored
    got = chunk_means(np.where(np.isnan(s), -np.inf, s), 8)
    for h in range(3):
        for c0 in range(0, 23, 8):
            run = s[h, c0 : c0 + 8]
            finite = run[np.isfinite(run)]
            for j, v in enumerate(run):
                want = v if np.isinf(v) else (-np.inf if np.isnan(v) else finite.mean())
                if np.isnan(v):  # a nan scores -inf, as the base treats it, and joins no mean
                    want = -np.inf
                assert got[h, c0 + j] == pytest.approx(want), (h, c0 + j)


@pytest.mark.parametrize("budget", [80, 120])
def test_chunk_wrapper_keeps_the_best_whole_runs(budget: int) -> None:
    snap = snapshot()
    m = _get_method("knorm+chunk@8")
    keep = m.select(snap, budget)
    check_keep(keep, L, H, N)
    prot = m.protected(snap)
    inner = _get_method("knorm")
    for il in range(L):
        s = np.where(prot[il], np.inf, inner.score(snap, il))
        for h in range(H):
            runs = [(np.mean([x for x in s[h, c : c + 8] if np.isfinite(x)] or [-np.inf]), c) for c in range(0, N, 8)]
            kept = set(keep[il, h].tolist())
            assert set(np.flatnonzero(prot[il, h])) <= kept
            # every run is whole or absent, but for at most one at the cut (the earliest of its cells)
            partial = [c for _, c in runs if 0 < len(kept & set(range(c, min(c + 8, N)))) < min(8, N - c)
                       and not all(prot[il, h, c : c + 8])]
            assert len(partial) <= 1 + sum(prot[il, h, c : c + 8].any() for _, c in runs), partial


def test_chunk_wrapper_takes_only_scorers() -> None:
    with pytest.raises(EdgekvError, match="chooses its cells itself"):
        _get_method("lagkv+chunk")
    with pytest.raises(EdgekvError, match="whole number"):
        _get_method("knorm+chunk@x")
    assert _get_method("kvzip+chunk@16").name == "kvzip+chunk@16"
    assert _get_method("kvzip+chunk@16").scratch_cells == _get_method("kvzip").scratch_cells
