"""edgekv serve, driven by OpenAI's own Python client over loopback, on the real model.

Every test checks the server's account (responses, the stats endpoint) against the
engines behind it: cells per conversation, no conversation left busy or leaked.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from _server import config, engine_view, running

from edgekv.lanes import Lanes
from edgekv.methods import METHODS, get_method
from edgekv.server import App, Settings

MODEL = "smollm2-135m"


def _client(base: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=300, **kw)


def _stats(base: str, headers: dict[str, str] | None = None) -> dict:
    req = urllib.request.Request(base + "/v1/edgekv/stats", headers=headers or {})
    with urllib.request.urlopen(req) as r:
        return json.load(r)


def _post(base: str, path: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _consistent(base: str, app: App) -> dict:
    """The stats endpoint agrees with the engines, and nothing is busy or half-made."""
    snap = _stats(base)
    live = {c["id"]: c["cells"] for c in snap["conversations"] if c["live"]}
    assert live == engine_view(app)
    assert snap["totals"]["cells"] == sum(live.values())
    assert all(c["state"] != "busy" for c in snap["conversations"])
    assert snap["totals"]["active_requests"] == 0
    # contexts (and lanes of the shared one) are reused, never leaked
    on_lanes = sum(c.session.lanes is not None for c in app.store.convs.values() if c.session is not None)
    assert len(live) - on_lanes + len(app.store._spare) <= app.cfg.max_live
    assert on_lanes + len(app.store._lane_spare) <= (app.store.lanes.n_lanes if app.store.lanes else 0)
    for conv in app.store.convs.values():
        if conv.session is not None:
            s = conv.session
            assert s.stats.cells == s.engine.n_cells <= app.cfg.n_ctx
            if not s.method.shifts_positions:  # one position per token (context_shift renumbers)
                assert s.stats.tokens_seen == s.n_past
    return snap


def _talk(base: str, method: str, rule: dict, *, turns: int = 3, max_tokens: int = 48, stream: bool = False,
          start: threading.Barrier | None = None) -> list:
    """A chat of ``turns`` turns with a long system prompt (each outgrows the small context):
    (reply, edgekv payload) per turn."""
    c = _client(base)
    msgs = [{"role": "system", "content": "You are a helpful assistant who answers at length. " * 8}]
    if start is not None:
        start.wait()
    out = []
    for q in ("Tell me about the sea, in detail.", "Now about mountains, in detail.", "And rivers, in detail?")[:turns]:
        msgs.append({"role": "user", "content": q})
        kw = {"model": MODEL, "messages": msgs, "max_tokens": max_tokens, "extra_body": {"method": method, **rule}}
        if stream:
            pieces, ek = [], None
            for ch in c.chat.completions.create(stream=True, **kw):
                if ch.choices and ch.choices[0].delta.content:
                    pieces.append(ch.choices[0].delta.content)
                if ch.model_extra.get("edgekv"):
                    ek = ch.model_extra["edgekv"]
            text = "".join(pieces)
        else:
            r = c.chat.completions.create(**kw)
            text, ek = r.choices[0].message.content, r.model_extra["edgekv"]
        msgs.append({"role": "assistant", "content": text})
        out.append((text, ek))
    return out


def _concurrently(base: str, methods: dict[str, dict], **kw) -> dict[str, list]:
    """One ``_talk`` per method, all at once (started together): each one's turns."""
    results: dict[str, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(methods))

    def run(method: str, rule: dict) -> None:
        try:
            results[method] = _talk(base, method, rule, start=start, **kw)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=item) for item in methods.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


@pytest.fixture(scope="module")
def served(smollm2, tmp_path_factory):
    app = App(config(smollm2, tmp_path_factory.mktemp("conversations")))
    with running(app) as base:
        yield base, app


def test_models_and_a_conversation_streamed_and_not(served) -> None:
    base, app = served
    c = _client(base)
    assert [m.id for m in c.models.list().data] == [MODEL]
    msgs = [{"role": "user", "content": "Name three colours."}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24)
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason in ("stop", "length")
    ek = r.model_extra["edgekv"]
    assert ek["continued"] is False and ek["method"] == "knorm" and ek["budget"] == 160
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert ek["tokens_seen"] == r.usage.total_tokens  # every token fed went through the cache
    # the same first turn, streamed: a new conversation (it does not extend the first one),
    # and greedy decoding gives the same text
    pieces, final = [], None
    for ch in c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, stream=True,
                                        stream_options={"include_usage": True}):
        if ch.choices and ch.choices[0].delta.content:
            pieces.append(ch.choices[0].delta.content)
        if ch.choices and ch.choices[0].finish_reason:
            final = ch
        if ch.usage:
            assert ch.usage.completion_tokens == r.usage.completion_tokens
    assert "".join(pieces) == text
    assert final is not None and final.model_extra["edgekv"]["conversation"] != ek["conversation"]
    # the next turn of the first conversation feeds only what is new
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "And three animals?"}]
    r2 = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24)
    ek2 = r2.model_extra["edgekv"]
    assert ek2["conversation"] == ek["conversation"] and ek2["continued"] is True
    assert r2.usage.prompt_tokens_details.cached_tokens == r.usage.total_tokens
    assert ek2["tokens_seen"] == r2.usage.total_tokens
    # an edit of the past starts over
    msgs[0] = {"role": "user", "content": "Name three shapes."}
    r3 = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8)
    assert r3.model_extra["edgekv"]["continued"] is False
    _consistent(base, app)


def test_completions_continue_a_prompt(served) -> None:
    base, app = served
    c = _client(base)
    prompt = "The capital of France is"
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
    assert r.choices[0].text and r.model_extra["edgekv"]["continued"] is False
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, stream=True) if ch.choices)
    assert streamed == r.choices[0].text
    r2 = c.completions.create(model=MODEL, prompt=prompt + r.choices[0].text + " The capital of Italy is", max_tokens=8)
    assert r2.model_extra["edgekv"]["continued"] is True
    assert r2.model_extra["edgekv"]["conversation"] == r.model_extra["edgekv"]["conversation"]
    # a stop string ends the reply before it, and is not sent
    r3 = c.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, stop=[" 7"])
    assert r3.choices[0].finish_reason == "stop" and " 7" not in r3.choices[0].text and "6" in r3.choices[0].text
    _consistent(base, app)


@pytest.mark.slow
def test_four_concurrent_conversations_with_different_methods(served) -> None:
    base, app = served
    methods = {"knorm": {"budget": 96}, "streaming_llm": {"budget": 128}, "lagkv": {"ratio": 0.5},
               "chelsea": {"budget": 128}}
    results = _concurrently(base, methods, max_tokens=64, stream=True)
    snap = _consistent(base, app)
    for method, rule in methods.items():
        turns = results[method]
        assert len(turns) == 3 and all(text for text, _ in turns)
        ids = {ek["conversation"] for _, ek in turns}
        assert len(ids) == 1 and [ek["continued"] for _, ek in turns] == [False, True, True]
        conv = next(c for c in snap["conversations"] if c["id"] in ids)
        assert conv["method"] == method and conv["budget"] == rule.get("budget") and conv["ratio"] == rule.get("ratio")
        assert conv["tokens_seen"] > app.cfg.n_ctx and conv["compressions"] >= 1  # each outgrew the context
        assert conv["cells"] <= app.cfg.n_ctx
        if method == "chelsea":
            assert conv["tokens_merged"] > 0 and conv["tokens_evicted"] == 0
        else:
            assert conv["tokens_evicted"] > 0 and conv["tokens_merged"] == 0


@pytest.mark.slow
def test_batched_conversations_share_a_context_and_answer_the_same(smollm2, tmp_path, served) -> None:
    """--batch: conversations whose methods a lane runs take sequences of one shared context,
    their tokens decoded together; the rest keep a context of their own; every reply is the
    one a context per conversation gives."""
    base, app = served
    batch_app = App(config(smollm2, tmp_path, batch=True))
    with running(batch_app) as batch_base:
        for method, rule in (("lagkv", {"ratio": 0.5}), ("snapkv", {"budget": 128})):
            alone, batched = _talk(base, method, rule), _talk(batch_base, method, rule)
            assert [t for t, _ in batched] == [t for t, _ in alone], method
            assert batched[-1][1]["compressions"] >= 1 and batched[-1][1]["lane"] is True
        methods = {"lagkv": {"ratio": 0.5}, "streaming_llm": {"budget": 128}, "knorm": {"budget": 96},
                   "chelsea": {"budget": 128}}
        results = _concurrently(batch_base, methods)
        snap = _consistent(batch_base, batch_app)
        for method in methods:
            ek = results[method][-1][1]
            assert ek["lane"] is (method != "chelsea") and ek["compressions"] >= 1 and ek["cells"] <= 256
        totals = snap["totals"]
        assert totals["batched_tokens"] > totals["batched_steps"] > 0  # steps that decoded several at once


@pytest.mark.slow
def test_every_method_in_concurrent_conversations(smollm2, tmp_path) -> None:
    """One conversation per registered method, all at once, on a --batch server with fewer
    live slots than conversations (so turns wait, and idle conversations are saved and
    resumed): every one answers three turns, outgrows its context and compresses, on a lane
    unless a lane cannot run its method. (``full`` cannot outgrow a context: it answers
    one turn.) The server starts with kvzip so that its contexts have scratch cells."""
    app = App(config(smollm2, tmp_path, batch=True, max_live=6, defaults=Settings("kvzip", 128)))
    special = {"context_shift": {}, "lagkv": {"ratio": 0.5}}  # lagkv's partitions need more than 128 cells
    rules = {m: special.get(m, {"budget": 128}) for m in METHODS if m != "full"}
    with running(app) as base:
        results = _concurrently(base, rules)
        full = _talk(base, "full", {}, turns=1, max_tokens=8)
        snap = _consistent(base, app)
    assert full[0][0] and full[0][1]["compressions"] == 0
    convs = {c["method"]: c for c in snap["conversations"]}
    for method in rules:
        turns = results[method]
        assert len(turns) == 3 and all(text for text, _ in turns), method
        ek = turns[-1][1]
        assert ek["compressions"] >= 1 and ek["cells"] <= app.cfg.n_ctx, method
        assert ek["lane"] is (Lanes.refusal(get_method(method)) is None), method
        assert convs[method]["tokens_seen"] > app.cfg.n_ctx, method
    assert snap["totals"]["batched_tokens"] > snap["totals"]["batched_steps"] > 0


@pytest.mark.slow
def test_thirty_turns_outgrow_the_context_and_keep_answering(smollm2, tmp_path) -> None:
    app = App(config(smollm2, tmp_path, defaults=Settings("streaming_llm", 128), n_ctx=192))
    with running(app) as base:
        c = _client(base)
        msgs: list[dict[str, str]] = []
        conv, seen = None, []
        for i in range(30):
            msgs.append({"role": "user", "content": f"Turn {i + 1}: give me one word that rhymes with cat."})
            r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12)
            text = r.choices[0].message.content
            assert text.strip(), f"turn {i + 1} got an empty reply"
            ek = r.model_extra["edgekv"]
            assert ek["continued"] is (i > 0)
            conv = conv or ek["conversation"]
            assert ek["conversation"] == conv and ek["cells"] <= 192
            assert ek["tokens_seen"] == r.usage.total_tokens
            seen.append(ek["tokens_seen"])
            msgs.append({"role": "assistant", "content": text})
        assert seen[-1] > 3 * 192 and ek["compressions"] >= 3
        assert ek["tokens_evicted"] == seen[-1] - ek["cells"]  # everything not held was evicted, and counted
        _consistent(base, app)


@pytest.mark.parametrize("room", [0, 96])
def test_the_server_makes_room_between_requests(smollm2, tmp_path, room: int) -> None:
    """With ``room``, the compression a conversation's next request would wait for runs after
    its turn, while no request waits: no request compresses inside itself, and the stats
    count the rooms made. Without it, the requests that fill the cache compress before
    their reply."""
    n_ctx = 256
    app = App(config(smollm2, tmp_path, defaults=Settings("snapkv", 128), n_ctx=n_ctx, room=room))
    with running(app) as base:
        c = _client(base)
        msgs: list[dict[str, str]] = []
        inside = []
        for i in range(12):
            msgs.append({"role": "user", "content": f"Turn {i + 1}: give me one word that rhymes with cat."})
            r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12)
            assert r.choices[0].message.content.strip()
            inside.append(r.model_extra["edgekv"]["compressions_this_request"])
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        deadline = time.time() + 60
        while not app.worker.idle:  # the last turn's room is made after its reply
            assert time.time() < deadline, "the worker did not go idle"
            time.sleep(0.05)
        snap = _consistent(base, app)
        (conv,) = snap["conversations"]
        assert conv["compressions"] >= 1
        if room:
            assert not any(inside), inside
            assert snap["totals"]["rooms_made"] == conv["compressions"]
            assert conv["cells"] + room <= n_ctx
        else:
            assert any(inside) and snap["totals"]["rooms_made"] == 0


def test_bad_requests_are_openai_errors_and_lose_nothing(served) -> None:
    base, app = served
    c = _client(base)
    msgs = [{"role": "user", "content": "Say hello."}]
    r0 = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8)
    keep = r0.model_extra["edgekv"]["conversation"]
    before = {cv["id"]: cv for cv in _stats(base)["conversations"]}
    cases = [
        (b"{not json", 400, "invalid_json", None),
        (b"[1, 2]", 400, "invalid_json", None),
        (json.dumps({"model": MODEL}).encode(), 400, "missing_required_parameter", "messages"),
        (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "invalid_type", "messages"),
        (json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}).encode(), 400,
         "invalid_value", "messages[0].role"),
        (json.dumps({"model": MODEL, "messages": msgs, "max_tokens": "ten"}).encode(), 400, "invalid_type", "max_tokens"),
        (json.dumps({"model": MODEL, "messages": msgs, "temperature": 9}).encode(), 400, "invalid_value", "temperature"),
        (json.dumps({"model": MODEL, "messages": msgs, "budget": True}).encode(), 400, "invalid_type", "budget"),
        (json.dumps({"model": MODEL, "messages": msgs, "stream": "yes"}).encode(), 400, "invalid_type", "stream"),
        (json.dumps({"model": MODEL, "messages": msgs, "n": 2}).encode(), 400, "unsupported_parameter", "n"),
        (json.dumps({"model": MODEL, "messages": msgs, "tools": [{"type": "function"}]}).encode(), 400,
         "unsupported_parameter", "tools"),
        (json.dumps({"model": "gpt-4o", "messages": msgs}).encode(), 404, "model_not_found", "model"),
        (json.dumps({"model": MODEL, "messages": msgs, "method": "magic"}).encode(), 400, "invalid_value", "method"),
        (json.dumps({"model": MODEL, "messages": msgs, "method": "knorm", "budget": 256}).encode(), 400,
         "invalid_value", "budget"),  # at or above --n-ctx
        (json.dumps({"model": MODEL, "messages": msgs, "method": "streaming_llm", "budget": 30}).encode(), 400,
         "invalid_value", "budget"),  # below its sinks + window
        (json.dumps({"model": MODEL, "messages": msgs, "method": "knorm", "ratio": 1.5}).encode(), 400,
         "invalid_value", "ratio"),
        (json.dumps({"model": MODEL, "prompt": 7}).encode(), 400, "invalid_type", "prompt"),
        (json.dumps({"model": MODEL, "messages": msgs, "method": "knorm", "method_params": {"sinks": "4"}}).encode(),
         400, "invalid_value", "method_params"),
        (json.dumps({"model": MODEL, "messages": msgs, "method_params": {"nope": 1}}).encode(), 400,
         "invalid_value", "method_params"),
        (json.dumps({"model": MODEL, "messages": [{"role": ["user"], "content": "x"}]}).encode(), 400,
         "invalid_value", "messages[0].role"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
         400, "unsupported_content", "messages[0].content"),
        (json.dumps({"model": MODEL, "messages": msgs, "response_format": {"type": "json_object"}}).encode(), 400,
         "unsupported_parameter", "response_format"),
        (json.dumps({"model": MODEL, "messages": msgs, "stream_options": {"include_usage": 1}}).encode(), 400,
         "invalid_type", "include_usage"),
        (b'{"model": "smollm2-135m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "invalid_json",
         None),
    ]
    for data, status, code, param in cases:
        path = "/v1/completions" if b'"prompt"' in data else "/v1/chat/completions"
        got, body = _post(base, path, data)
        assert (got, body["error"]["code"], body["error"]["param"]) == (status, code, param), (data, body)
        assert body["error"]["message"] and "\n" not in body["error"]["message"]
    # a prompt larger than the whole context with method full: refused before anything is fed
    long = " ".join(["word"] * 400)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=4,
                                  extra_body={"method": "full"})
    assert e.value.code == "context_length_exceeded"
    # ... which a compressing method serves
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=4)
    assert r.model_extra["edgekv"]["compressions"] >= 1
    # the first conversation is untouched and continues
    after = {cv["id"]: cv for cv in _stats(base)["conversations"]}
    assert after[keep]["cells"] == before[keep]["cells"] and after[keep]["tokens_seen"] == before[keep]["tokens_seen"]
    msgs += [{"role": "assistant", "content": r0.choices[0].message.content}, {"role": "user", "content": "Again."}]
    r2 = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8)
    assert r2.model_extra["edgekv"]["conversation"] == keep
    # no conversation was made by a refused request
    made = set(after) - set(before)
    assert len(made) == 1  # the long prompt's
    _consistent(base, app)


def test_prompt_limit_and_api_key(smollm2, tmp_path) -> None:
    app = App(config(smollm2, tmp_path, max_prompt_tokens=64), api_key="s3cret")
    with running(app) as base:
        with pytest.raises(openai.AuthenticationError):
            _client(base).models.list()
        c = _client(base, api_key="s3cret")
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 200}], max_tokens=4)
        assert e.value.code == "prompt_too_long"
        assert c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert _stats(base, {"Authorization": "Bearer s3cret"})["totals"]["conversations"] == 1


def test_a_client_that_disconnects_mid_stream(served) -> None:
    base, app = served
    c = _client(base)
    n0 = len(_stats(base)["conversations"])
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to fifty."}],
                                       max_tokens=64, stream=True)
    got = 0
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            got += 1
        if got == 3:
            break
    stream.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        snap = _stats(base)
        if snap["totals"]["active_requests"] == 0 and len(snap["conversations"]) == n0:
            break
        time.sleep(0.1)
    # the abandoned conversation is gone with its context; the others are as they were
    assert len(snap["conversations"]) == n0
    _consistent(base, app)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize("engine,method", [("native", "knorm"), ("state", "knorm"), ("native", "chelsea"),
                                           ("native", "expected_attention"), ("state", "kvzip")])
def test_saved_to_disk_and_resumed_answers_as_if_never_saved(smollm2, tmp_path, engine, method) -> None:
    """With one live context, a second conversation pushes the first to a session file; its
    next turn, resumed from the file, is the greedy continuation it would have had."""
    q1 = "Write two sentences about a lighthouse keeper. " * 14
    q2 = "What happened next?"

    def conversation(c, other: bool) -> tuple[str, str, dict]:
        m = [{"role": "user", "content": q1}]
        a1 = c.chat.completions.create(model=MODEL, messages=m, max_tokens=40).choices[0].message.content
        if other:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there."}], max_tokens=8)
        m += [{"role": "assistant", "content": a1}, {"role": "user", "content": q2}]
        r = c.chat.completions.create(model=MODEL, messages=m, max_tokens=40)
        return a1, r.choices[0].message.content, r.model_extra["edgekv"]

    settings = Settings(method, 96)
    app = App(config(smollm2, tmp_path / "a", defaults=settings, engine=engine, n_ctx=160, max_live=1))
    with running(app) as base:
        a1, a2, ek = conversation(_client(base), other=True)
        snap = _consistent(base, app)
        assert snap["totals"]["saves"] >= 2 and snap["totals"]["resumes"] >= 1
        assert ek["continued"] and ek["compressions"] >= 1 and ek["engine"] == engine
    app2 = App(config(smollm2, tmp_path / "b", defaults=settings, engine=engine, n_ctx=160, max_live=4))
    with running(app2) as base:
        b1, b2, ek2 = conversation(_client(base), other=False)
        assert _stats(base)["totals"]["saves"] == 0
    assert (a1, a2) == (b1, b2)
    assert (ek["cells"], ek["tokens_seen"], ek["compressions"]) == (ek2["cells"], ek2["tokens_seen"], ek2["compressions"])


@pytest.mark.slow
def test_the_load_bench_small_version(tmp_path) -> None:
    """bench/server_load.py, small: 4 conversations over 2 live contexts (so every turn saves and
    resumes), all answered, nothing busy or leaked, memory back within 5 % of its warm-up value."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "load.json"
    script = Path(__file__).resolve().parents[1] / "bench" / "server_load.py"
    r = subprocess.run([sys.executable, str(script), "--conversations", "4", "--turns", "3", "--max-tokens", "16",
                        "--max-live", "2", "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-1000:] + r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["ok"] and d["answered"] == 12 and not d["errors"]
    assert d["server"]["resumes"] >= 4 and d["server"]["live"] <= 2 and d["continued_fraction"] == 1.0


def test_a_method_the_engine_cannot_run_is_refused(gemma3, tmp_path) -> None:
    """Gemma 3's sliding-window cache runs on the state engine, which has no merge bias:
    chelsea is a 400 that says so, given by the request handler before any conversation is
    made, and chelsea_nobias is served. As the server's default, chelsea stops it at start."""
    from edgekv.errors import EdgekvError

    with pytest.raises(EdgekvError, match="bias"):
        App(config(gemma3, tmp_path, model_id="gemma3-270m", defaults=Settings("chelsea", 160)))
    app = App(config(gemma3, tmp_path, model_id="gemma3-270m", defaults=Settings("streaming_llm", 160)))
    with running(app) as base:
        c = _client(base)
        msgs = [{"role": "user", "content": "Hello!"}]
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="gemma3-270m", messages=msgs, max_tokens=4, extra_body={"method": "chelsea"})
        assert "bias" in str(e.value) and "state engine" in str(e.value)
        assert e.value.body["param"] == "method" and e.value.status_code == 400
        assert _stats(base)["totals"]["conversations"] == 0 and app.store.created == 0
        r = c.chat.completions.create(model="gemma3-270m", messages=msgs, max_tokens=4,
                                      extra_body={"method": "chelsea_nobias"})
        assert r.model_extra["edgekv"]["engine"] == "state" and r.model_extra["edgekv"]["method"] == "chelsea_nobias"
        assert app.store.created == 1
        _consistent(base, app)


def test_a_method_needing_scratch_cells_is_served_only_where_contexts_have_them(served) -> None:
    """KVzip repeats the context in cells beside each conversation's: a server started with
    another method has none in its pooled contexts, so a request for kvzip is a 400 naming the
    fix, before any conversation is made; Expected Attention needs none and is served."""
    base, app = served
    c = _client(base)
    msgs = [{"role": "user", "content": "Tell me about lighthouses."}]
    made = app.store.created
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, extra_body={"method": "kvzip"})
    assert "--method kvzip" in str(e.value) and e.value.body["param"] == "method" and "\n" not in str(e.value)
    assert app.store.created == made
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, extra_body={"method": "expected_attention"})
    assert r.model_extra["edgekv"]["method"] == "expected_attention" and app.store.created == made + 1
    _consistent(base, app)


def test_serve_refuses_bad_settings_with_one_line(tmp_path, smollm2_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    edgekv = str(Path(sys.executable).parent / "edgekv")
    for args, msg in ((["--method", "knorm", "--budget", "2000", "--n-ctx", "1024"], "must be below --n-ctx"),
                      (["--method", "nope"], "unknown method"),
                      ([str(tmp_path / "missing.gguf")], "neither a file nor a known model"),
                      (["--max-live", "0"], "--max-live")):
        r = subprocess.run([edgekv, "serve", *args, "--port", "1"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and msg in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)


def test_seeds_and_replies_the_client_trims_or_cuts(served) -> None:
    base, app = served
    c = _client(base)
    msgs = [{"role": "user", "content": "Write a sentence about the moon."}]
    same = [c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=1.0, seed=7)
            .choices[0].message.content for _ in range(2)]
    assert same[0] == same[1]  # a seed is a seed, whatever ran on the context before
    # a reply cut by a stop string, sent back trimmed: the next turn continues and feeds only the new turn
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=32, stop=["."])
    assert r.choices[0].finish_reason in ("stop", "length")
    for turn in range(3):
        msgs += [{"role": "assistant", "content": r.choices[0].message.content.strip()},
                 {"role": "user", "content": f"Another one, number {turn + 2}."}]
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=32, stop=["."])
        assert r.model_extra["edgekv"]["continued"]
        new = r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens
        assert new < 30, f"turn {turn + 2} fed {new} prompt tokens: earlier turns again"
    _consistent(base, app)


def test_conversations_outlive_a_restart_with_a_state_dir(smollm2, tmp_path) -> None:
    """persist: every completed turn is recorded at once, each cache is saved at shutdown; the
    next server on the same directory continues each conversation with the answer an
    uninterrupted server gives."""
    from edgekv.errors import EdgekvError

    first = [{"role": "user", "content": "Tell me about a small harbour town and the people who live there. " * 8}]
    later = "Who is the oldest of them?"

    def server(state, **kw) -> App:
        return App(config(smollm2, state, n_ctx=kw.pop("n_ctx", 160), defaults=Settings("knorm", 96), **kw))

    def ask(base: str, msgs: list) -> tuple[str, dict]:
        r = _client(base).chat.completions.create(model=MODEL, messages=msgs, max_tokens=24)
        return r.choices[0].message.content, r.model_extra["edgekv"]

    with running(server(tmp_path / "plain")) as base:  # uninterrupted
        a1, _ = ask(base, first)
        want, ek0 = ask(base, [*first, {"role": "assistant", "content": a1}, {"role": "user", "content": later}])
    kept = tmp_path / "kept"
    with running(server(kept, persist=True)) as base:
        text, ek = ask(base, first)
        assert text == a1
        record = kept / f"{ek['conversation']}.json"
        rec = json.loads(record.read_text())  # on disk before the reply ended, no cache named yet
        assert rec["messages"] == [*first, {"role": "assistant", "content": a1}] and rec["cache_sha256"] is None
    rec = json.loads(record.read_text())  # the clean exit saved the cache, and the record names it
    cache = kept / f"{ek['conversation']}.ekv"
    assert rec["cache_sha256"] == cache.read_bytes()[-32:].hex()
    with running(server(kept, persist=True)) as base:
        assert _stats(base)["totals"]["saved"] == 1
        text, ek = ask(base, [*first, {"role": "assistant", "content": a1}, {"role": "user", "content": later}])
        assert _stats(base)["totals"]["resumes"] == 1
    assert ek["continued"] and not ek["rebuilt"] and ek["compressions"] >= 1 and ek["requests"] == 2
    assert text == want and (ek["cells"], ek["tokens_seen"]) == (ek0["cells"], ek0["tokens_seen"])
    # a server of another shape on that directory stops at start, and loses nothing
    before = record.read_bytes()
    with pytest.raises(EdgekvError, match="n_ctx 160"):
        server(kept, n_ctx=192, persist=True)
    assert record.read_bytes() == before and cache.is_file()
    # a record that does not parse stops the server with one line naming it, and loses nothing
    (kept / "conv-0000.json").write_text("{not json")
    with pytest.raises(EdgekvError, match="conv-0000.json is not a readable conversation record"):
        server(kept, persist=True)
    (kept / "conv-0000.json").unlink()
    # the index earlier servers wrote at a clean exit becomes records, paired with their caches
    old = {"version": 1, **{k: rec["shape"][k] for k in rec["shape"]}, "conversations": [
        {**{k: rec[k] for k in ("id", "kind", "messages", "text", "reply_len", "requests", "last_used",
                                "settings", "stats")}, "file": cache.name}]}
    record.unlink()
    (kept / "conversations.json").write_text(json.dumps(old))
    with running(server(kept, persist=True)) as base:
        assert not (kept / "conversations.json").exists() and record.is_file()
        assert _stats(base)["totals"]["saved"] == 1
    # a cache file damaged on disk (its digest no longer matches its bytes) is refused when the
    # conversation resumes: it is rebuilt from its messages, under the same id
    blob = bytearray(cache.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    cache.write_bytes(bytes(blob))
    with running(server(kept, persist=True)) as base:
        text, ek2 = ask(base, [*first, {"role": "assistant", "content": a1}, {"role": "user", "content": later}])
    assert ek2["conversation"] == ek["conversation"] and ek2["continued"] and ek2["rebuilt"] and text
    assert json.loads(record.read_text())["requests"] == 2
    # a saved conversation whose settings this edgekv cannot run (a method since removed) is
    # not resumed: the server starts, its files go, and the same messages start over
    rec = json.loads(record.read_text())
    rec["settings"]["method"] = "retired_method"
    record.write_text(json.dumps(rec))
    with running(server(kept, persist=True)) as base:
        assert _stats(base)["totals"]["conversations"] == 0 and not list(kept.glob("conv-*"))
        text, ek = ask(base, [*first, {"role": "assistant", "content": a1}, {"role": "user", "content": later}])
        assert not ek["continued"] and text
