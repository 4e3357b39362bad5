"""Every registered method's parameters, drawn at random (hypothesis, bounded).

Whatever ``get_method`` accepts compresses a real SmolLM2 cache correctly: the
target is reached, the sinks and the recent window are still there, and both
engines leave the same cells. Whatever it refuses is one line that names the
parameter. Values are drawn around each parameter's default, across its edges
(zero, negatives, huge), and of wrong types.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgekv.errors import EdgekvError
from edgekv.kvcache import native_available
from edgekv.methods import METHODS, ScorerMethod, get_method
from edgekv.profiles import HeadProfile, file_sha256, save_profile
from edgekv.session import Session

TEXT = ("The lighthouse keeper wrote in her log every evening: the weather, the ships that "
        "passed, the state of the lamp, and the small things that happened on the island. ") * 12
N_CTX = 1024
WINDOW = 64  # queries observed during the prefill, for the window-scoring methods


def _value(default: object) -> st.SearchStrategy:
    """Values for a parameter whose default is ``default``: its type mostly, around the edges."""
    wrong = st.sampled_from(["3", None, [1]])
    if isinstance(default, bool):
        return st.one_of(st.booleans(), st.integers(0, 1), wrong)
    if isinstance(default, int):
        return st.one_of(st.integers(-3, 3), st.integers(0, 2 * max(default, 8)), st.integers(-10**6, 10**6),
                         st.floats(0.5, 3.5), st.booleans(), wrong)
    if isinstance(default, float):
        return st.one_of(st.floats(-0.5, 1.5), st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 3),
                         wrong)
    return st.one_of(st.text(max_size=8), wrong)


def _plausible(default: object) -> st.SearchStrategy:
    """Values of the parameter's type near its default and its edges: mostly accepted."""
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return st.one_of(st.integers(-2, 2), st.integers(0, 2 * max(default, 16)))
    if isinstance(default, float):
        return st.one_of(st.just(default), st.floats(0.0, 1.0), st.floats(-0.1, 1.1))
    return st.just(default)


def _params(name: str, values=_value) -> st.SearchStrategy[dict[str, object]]:
    fields = {f.name: f.default for f in dataclasses.fields(METHODS[name])
              if f.init and f.default is not dataclasses.MISSING and f.name != "profile"}
    return st.fixed_dictionaries({}, optional={k: values(d) for k, d in fields.items()})


def _check_refusal(err: EdgekvError, params: dict[str, object]) -> None:
    msg = str(err)
    assert "\n" not in msg and msg, msg
    assert any(k in msg for k in params) or "budget" in msg, f"{msg!r} names none of {sorted(params)}"


@pytest.mark.parametrize("name", list(METHODS))
@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data())
def test_what_get_method_accepts_or_refuses(name: str, data) -> None:
    """Accepted: a method whose own parameters hold (sinks, window whole and >= 0); refused:
    one line naming a parameter it was given."""
    params = data.draw(_params(name))
    try:
        m = get_method(name, **params)
    except EdgekvError as e:
        _check_refusal(e, params)
        return
    for k, v in params.items():
        assert getattr(m, k) == v or (isinstance(v, float) and math.isnan(v))
    for k in ("sinks", "window"):
        assert isinstance(getattr(m, k), int) and getattr(m, k) >= 0, (k, getattr(m, k))


@pytest.fixture(scope="module")
def prefilled(smollm2, tmp_path_factory):
    """Per engine: a session holding TEXT with every statistic a method may ask for, and its save."""
    info = smollm2.info
    profile = tmp_path_factory.mktemp("profile") / "p.json"
    scores = np.random.default_rng(0).random((info.n_layer, info.n_head)).round(4)
    save_profile(HeadProfile(info.path.name, file_sha256(info.path), list(range(info.n_layer)), scores.tolist(),
                             1, 1), profile)
    out = {}
    engines = ["state", "native"] if native_available() else ["state"]
    for engine in engines:
        s = Session(smollm2, method="full", n_ctx=N_CTX, engine=engine, n_threads=2, observe=WINDOW, tally=True,
                    moments=True, scratch_cells=512)
        s.feed_text(TEXT)
        out[engine] = (s, s.save())
    yield out, str(profile)
    for s, _ in out.values():
        s.close()


def _compress(s: Session, saved, name: str, budget: int, params: dict) -> tuple | str:
    """(cells' token positions, blob) after one compression to ``budget``, or the one-line refusal."""
    s.restore(saved)
    try:
        s.use(name, budget=budget, scheduled=False, **params)
        s.compress()
    except EdgekvError as e:
        return str(e)
    s.feed(s.model.tokenize(" The end.", add_special=False)[:1])  # decoding goes on over what is left
    state = s.engine.save()
    return state.token_pos.copy(), state.blob


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in METHODS if n != "full"])
def test_accepted_parameters_compress_a_real_cache_correctly(prefilled, name: str) -> None:
    sessions, profile = prefilled
    n = next(iter(sessions.values()))[1][0].token_pos.shape[-1]  # the saved prefill's cells
    strategy = st.tuples(_params(name, _plausible), st.one_of(st.integers(1, n + 8), st.integers(n // 3, n)))
    outcomes: list[str] = []

    @settings(max_examples=14, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def check(drawn) -> None:
        params, budget = drawn
        if name == "compresskv":
            params = {**params, "profile": profile}
        try:
            m = get_method(name, **params)
        except EdgekvError as e:
            _check_refusal(e, params)
            outcomes.append("refused")
            return
        runs = {engine: _compress(s, saved, name, budget, params) for engine, (s, saved) in sessions.items()}
        state = runs["state"]
        for engine, r in runs.items():
            outcomes.append(f"{engine} " + ("refused" if isinstance(r, str) else "compressed"))
            if isinstance(r, str):  # refused: one line, and by the budget check or the engine's needs
                assert "\n" not in r and r
                if "budget" not in r:
                    assert engine == "state" and "needs" in r, r
                continue
            tp, _ = r
            cells = tp.shape[-1] - 1  # the compression's, before the token decoded after it
            if budget >= n:
                assert cells == n
            elif m.shifts_positions:
                assert cells == n - m.n_discard(n)
            elif isinstance(m, ScorerMethod):  # the base's top-k: exactly the target
                assert cells == budget, (engine, cells, budget)
            else:  # merging, or LagKV's budget mode (room for the tokens until its next step)
                assert cells <= budget, (engine, cells, budget)
            for pos in [*range(min(m.sinks, n)), *range(max(n - m.window, 0), n + 1)]:
                assert (tp == pos).any(axis=-1).all(), \
                    f"{engine}: token {pos} of {n} is gone (sinks {m.sinks}, window {m.window}, budget {budget})"
        if "native" in runs and isinstance(state, tuple) and isinstance(runs["native"], tuple):
            assert np.array_equal(state[0], runs["native"][0]) and state[1] == runs["native"][1], \
                f"{name} {params} budget {budget}: the engines left different caches"

    check()
    print(name, {k: outcomes.count(k) for k in sorted(set(outcomes))})
    assert any(o.endswith("compressed") for o in outcomes), f"{name}: no drawn parameter set compressed"
