"""The embedding API: a Session on an app's existing ``llama_cpp.Llama`` (its weights shared,
edgekv's own context), the callbacks, and save/resume giving the uninterrupted continuation."""

from __future__ import annotations

import llama_cpp
import pytest

from edgekv import Session
from edgekv.errors import EdgekvError
from edgekv.llama import Model


@pytest.fixture(scope="module")
def llm(smollm2_path):
    llm = llama_cpp.Llama(model_path=str(smollm2_path), n_ctx=256, verbose=False)
    yield llm
    llm.close()


def test_a_session_shares_the_llama_weights(llm) -> None:
    events, progress = [], []
    with Session(llm, method="knorm", budget=96, n_ctx=160, n_threads=2, on_compress=events.append) as s:
        assert s.model.ptr == llm.model  # the same loaded weights, not a second copy
        assert s.ctx.ptr != llm.ctx  # edgekv's own context
        text = "The history of the lighthouse began with fires on hilltops. " * 20
        s.feed_text(text, progress=lambda done, total: progress.append((done, total)))
        assert events and events == s.stats.events and all(e.after == 96 for e in events)
        assert progress[-1][0] == progress[-1][1] == s.stats.tokens_seen
        out = "".join(s.generate(8))
        assert out.strip()
    # the Llama still works after the Session is gone: edgekv never freed its model
    assert llm.tokenize(b"hello")
    assert Model.from_llama(llm).arch.n_layer == 30


def test_a_closed_llama_is_refused(smollm2_path) -> None:
    other = llama_cpp.Llama(model_path=str(smollm2_path), n_ctx=64, verbose=False)
    other.close()
    with pytest.raises(EdgekvError, match="open llama_cpp.Llama"):
        Session(other)
    with pytest.raises(EdgekvError, match="open llama_cpp.Llama"):
        Session(object())


@pytest.mark.parametrize("engine,method", [("native", "knorm"), ("state", "knorm"), ("native", "chelsea"),
                                           ("state", "chelsea_nobias")])
def test_save_then_resume_continues_as_if_uninterrupted(llm, tmp_path, engine, method) -> None:
    first = "A short history of ships and the sea, told by an old sailor. " * 12
    second = " Then the sailor said:"
    kw = dict(method=method, budget=100, n_ctx=160, n_threads=2, engine=engine)
    with Session(llm, **kw) as a:
        a.feed_text(first)
        head = list(a.generate_tokens(16))
        assert a.stats.compressions >= 1  # the saved cache is a compressed one
        a.save_file(tmp_path / "conv.ekv")
        a.feed_text(second, add_special=False)
        reference = list(a.generate_tokens(24))
        ref_stats = (a.stats.cells, a.stats.tokens_seen, a.n_past)
    with Session(llm, **kw) as b:
        b.load_file(tmp_path / "conv.ekv")
        b.feed_text(second, add_special=False)
        assert list(b.generate_tokens(24)) == reference
        assert (b.stats.cells, b.stats.tokens_seen, b.n_past) == ref_stats
    assert head
