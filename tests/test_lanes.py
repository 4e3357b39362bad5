"""Sessions sharing one context (edgekv.lanes): their generated tokens decoded in one batch.

Each lane must end exactly where a session with a context of its own ends when it is fed
the same tokens: the same cells at the same positions, the same compressions, and the same
next-token distribution (up to the float rounding of a batch of several rows).
"""

from __future__ import annotations

import numpy as np
import pytest

from edgekv.config import ContextOptions
from edgekv.errors import BudgetError, EdgekvError
from edgekv.lanes import Lanes
from edgekv.llama import Context, Sampler, SamplerConfig
from edgekv.session import Reply, Session

OPTS = ContextOptions(n_threads=2, engine="state", chunk=128)
CELLS = 320
# one per lane: evicting, position-shifting, merging and attention-scored methods (the last
# two read the queries the batch recorded: the window, and the statistics before RoPE), each
# outgrowing its lane
RULES = [("streaming_llm", {"budget": 200}), ("lagkv", {"budget": 200, "method_params": {"L": 32}}),
         ("context_shift", {}), ("chelsea_nobias", {"budget": 200}), ("snapkv", {"budget": 200}),
         ("expected_attention", {"budget": 200})]
GENERATED = 100


def _prompts(model, n: int) -> list[list[int]]:
    text = ("The harbour town woke before dawn. Fishermen mended nets while the baker lit his ovens, "
            "and the lighthouse keeper climbed the stairs one last time before the morning shift. ")
    toks = model.tokenize(text * 20, add_special=False)
    return [toks[i * 37 : i * 37 + 300] for i in range(n)]


def test_sample_logits_draws_what_sample_draws(smollm2) -> None:
    """The chain applied to a copy of the logits picks the same tokens as llama.cpp's
    ``llama_sampler_sample`` on the context's, draw after draw (greedy and seeded)."""
    ctx = Context(smollm2, n_ctx=128, n_threads=2, capture=False)
    try:
        ctx.decode(smollm2.tokenize("The capital of France is", add_special=True), 0)
        logits = ctx.logits(-1)
        for cfg in (SamplerConfig(), SamplerConfig(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7),
                    SamplerConfig(temperature=0.8, seed=3)):
            a, b = Sampler(cfg), Sampler(cfg)
            drawn = [a.sample(ctx) for _ in range(40)]
            assert drawn == [b.sample_logits(logits) for _ in range(40)]
            a.close()
            b.close()
        assert len(set(drawn)) > 1  # the seeded draws vary: the comparison is not of constants
    finally:
        ctx.close()


@pytest.mark.kernels  # a batch of several rows against one row at a time
def test_lanes_end_where_contexts_of_their_own_end(smollm2) -> None:
    _lanes_against_contexts_of_their_own(smollm2, RULES)


@pytest.mark.kernels
def test_iswa_lanes_end_where_contexts_of_their_own_end(gemma3) -> None:
    """Gemma 3 (15 of 18 layers attend over a 512-token window): each lane's stream holds
    a window plus a batch in its sliding-window cache, as a context of its own does, and
    compresses its full-attention layers as that context does."""
    assert gemma3.arch.n_swa
    _lanes_against_contexts_of_their_own(gemma3, RULES[:3])


def _lanes_against_contexts_of_their_own(model, rules: list[tuple[str, dict]]) -> None:
    lanes = Lanes(model, len(rules), CELLS, OPTS)
    prompts = _prompts(model, len(rules))
    batched = [Session(model, method=m, n_ctx=CELLS, options=OPTS, lanes=lanes, **kw) for m, kw in rules]
    try:
        for sess, p in zip(batched, prompts, strict=True):
            sess.feed(p)
        generated: list[list[int]] = [[] for _ in batched]
        cfg = SamplerConfig(temperature=0.7, seed=11)
        for _ in range(GENERATED):  # round-robin, as the server's worker steps its turns
            for sess, out in zip(batched, generated, strict=True):
                if len(out) == 0 or out[-1] >= 0:
                    tok = sess.step(cfg)
                    out.append(-1 if tok is None else tok)
        for sess in batched:
            sess.settle()
        made = [[t for t in out if t >= 0] for out in generated]
        assert lanes.tokens == sum(map(len, made))
        assert lanes.steps <= GENERATED + 1 and lanes.tokens > len(rules) / 2 * lanes.steps  # together, not in turn
        for (name, kw), sess, p, toks in zip(rules, batched, prompts, made, strict=True):
            solo = Session(model, method=name, n_ctx=CELLS, options=OPTS, **kw)
            try:
                solo.feed(p)
                for t in toks:
                    solo.feed([t])
                assert sess.stats.compressions == solo.stats.compressions >= 1, name
                assert (sess.n_past, sess.stats.tokens_seen) == (solo.n_past, solo.stats.tokens_seen), name
                assert np.array_equal(sess.engine.cell_positions(), solo.engine.cell_positions()), name
                a, b = sess.logits(), solo.logits()
                assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max(), (name, np.abs(a - b).max())
            finally:
                solo.close()
    finally:
        for sess in batched:
            sess.close()
        assert lanes.free == len(rules)
        lanes.close()


def test_a_lane_file_loads_into_a_context_of_its_own_and_back(smollm2, tmp_path) -> None:
    lanes = Lanes(smollm2, 2, CELLS, OPTS)
    p = _prompts(smollm2, 1)[0]
    try:
        lane = Session(smollm2, method="knorm", budget=160, n_ctx=CELLS, options=OPTS, lanes=lanes)
        lane.feed(p)
        lane.step()  # queued: save_file decodes it first
        lane.save_file(tmp_path / "lane.edgekv")
        solo = Session(smollm2, method="knorm", budget=160, n_ctx=CELLS, options=OPTS)
        solo.load_file(tmp_path / "lane.edgekv")
        assert solo.n_past == lane.n_past == len(p) + 1 and solo.stats.compressions == 0
        for t in p[:5]:
            solo.feed([t])
            lane.feed([t])
            np.testing.assert_allclose(lane.logits(), solo.logits(), rtol=0, atol=1e-3 * np.abs(solo.logits()).max())
        solo.save_file(tmp_path / "solo.edgekv")
        other = Session(smollm2, method="knorm", budget=160, n_ctx=CELLS, options=OPTS, lanes=lanes)
        other.load_file(tmp_path / "solo.edgekv")
        assert np.array_equal(other.engine.cell_positions(), solo.engine.cell_positions())
        solo.close()
        other.close()
        lane.close()
        assert lanes.free == 2 and lanes.ctx.pos_max(0) == -1 and lanes.ctx.pos_max(1) == -1
    finally:
        lanes.close()


def test_what_a_lane_refuses(smollm2) -> None:
    lanes = Lanes(smollm2, 1, CELLS, OPTS)
    try:
        for method, why in (("h2o", "sums llama.cpp's softmax over a whole batch"), ("chelsea", "log-count bias"),
                            ("kvzip", "scratch cells")):
            with pytest.raises(EdgekvError, match=f"cannot run on a lane.*{why}") as e:
                Session(smollm2, method=method, budget=160, n_ctx=CELLS, options=OPTS, lanes=lanes)
            assert "\n" not in str(e.value)
        with pytest.raises(BudgetError, match="does not fit a lane"):
            Session(smollm2, n_ctx=CELLS * 2, options=OPTS, lanes=lanes)
        with pytest.raises(EdgekvError, match="cannot take a lane"):
            Session(smollm2, n_ctx=CELLS, options=ContextOptions(cache_type_k="q8_0"), lanes=lanes)
        with pytest.raises(EdgekvError, match="state engine"):
            Session(smollm2, n_ctx=CELLS, options=ContextOptions(engine="native"), lanes=lanes)
        assert lanes.free == 1  # refused sessions took no lane
        held = Session(smollm2, n_ctx=CELLS, options=OPTS, lanes=lanes)
        with pytest.raises(EdgekvError, match="all 1 lanes"):
            Session(smollm2, n_ctx=CELLS, options=OPTS, lanes=lanes)
        held.close()
        assert lanes.accepts(held.rule.but("snapkv").build()) and not lanes.accepts(held.rule.but("h2o").build())
    finally:
        lanes.close()


def test_a_full_lane_ends_its_reply_instead_of_failing(smollm2) -> None:
    """A method that never compresses stops at the capacity, its queued token counted: the
    reply ends ("length") with the cache exactly full, as in a context of its own."""
    lanes = Lanes(smollm2, 1, 128, OPTS)
    try:
        sess = Session(smollm2, n_ctx=128, options=OPTS, lanes=lanes)
        sess.feed(_prompts(smollm2, 1)[0][:120])
        reply = Reply()
        for _ in sess.stream(50, reply=reply, until_full=True):
            pass
        sess.settle()
        assert sess.engine.n_cells <= 128
        if reply.finish != "stop":  # not ended by the model itself
            assert (reply.finish, sess.engine.n_cells, reply.tokens) == ("length", 128, 8)
        sess.close()
    finally:
        lanes.close()
