"""Fuzzing, bounded in time: GGUF headers through the commands a user runs, state blobs
through the state engine's parser, request bodies through the server.

The GGUF and state-blob fuzzers are the scripts in bench/ (run long there; short here),
each in its own process so that a crash inside llama.cpp fails the test instead of
killing it. Seeds of past failures are replayed first.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from _server import config, engine_view, running
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgekv.methods import METHODS
from edgekv.server import App, Settings

ROOT = Path(__file__).resolve().parents[1]
SEEDS = Path(__file__).parent / "data" / "fuzz_gguf_seeds.json"
MODEL = "smollm2-135m"

pytestmark = pytest.mark.slow


def _script(name: str, out: Path, *args: str, timeout: float) -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), *args, "--json", str(out)],
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return json.loads(out.read_text())


def test_gguf_headers_through_info_generate_and_serve(tmp_path) -> None:
    """Every committed seed (a vocabulary with a duplicate token string among them, which
    once aborted llama.cpp) and 24 random mutants: each answered or refused with one line;
    no crash, hang or traceback."""
    seeds = json.loads(SEEDS.read_text())
    d = _script("fuzz_gguf", tmp_path / "gguf.json", "--replay", str(SEEDS), "--count", "24", "--seconds", "90", "--seed", "2026",
                timeout=900)
    assert d["ok"] and d["mutants"] >= len(seeds) + 8, d
    refused = sum(v for k, v in d["counts"].items() if k.endswith("refused"))
    assert refused >= len(seeds) * 3  # each seed through info, generate and serve


def test_state_blobs_through_the_state_engines_parser(tmp_path) -> None:
    """Mutated sequence-state blobs of a real cache, f16 with V transposed and q8_0: every
    layout change refused with one line and the saved state restoring byte for byte after."""
    for args in (["--cache-type", "f16", "--flash-attn", "off", "--seed", "1"],
                 ["--cache-type", "q8_0", "--seed", "2"]):
        d = _script("fuzz_state", tmp_path / "state.json", *args, "--count", "400", "--seconds", "60", timeout=600)
        assert d["ok"] and d["mutants"] >= 100 and d["counts"].get("refused", 0) >= 50, d


# -- server request bodies --------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
ODD = st.sampled_from([None, "3", 2.5, True, -1, 2**40, [], {}])
MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "bogus"]) | JSON,
    "content": st.text(max_size=30) | JSON | st.lists(st.fixed_dictionaries(
        {"type": st.just("text") | JSON, "text": st.text(max_size=20) | JSON}), max_size=2),
})
FIELDS = {
    "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "prompt": st.text(max_size=30) | st.lists(st.text(max_size=10), max_size=2) | JSON,
    "max_tokens": st.integers(-2, 4) | ODD,
    "max_completion_tokens": st.integers(-2, 4) | ODD,
    "temperature": st.floats(-1, 3) | JSON,
    "top_p": st.floats(-0.5, 1.5) | JSON,
    "seed": st.integers(-2**65, 2**65) | JSON,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=5) | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JSON}) | JSON,
    "method": st.sampled_from([*METHODS, "knorm+rerotate", "nosuch"]) | JSON,
    "budget": st.integers(-5, 300) | JSON,
    "ratio": st.floats(-0.5, 1.5) | JSON,
    "method_params": st.dictionaries(st.sampled_from(["sinks", "window", "chunk", "r", "L", "kernel", "nope"]),
                                     st.integers(-3, 300) | st.floats(-1, 2) | JSON, max_size=3) | JSON,
    "n": st.integers(0, 3) | JSON,
    "logprobs": st.booleans() | JSON,
    "response_format": st.just({"type": "text"}) | JSON,
    "tools": JSON,
}
BODY = st.fixed_dictionaries({"model": st.just(MODEL) | JSON}, optional=FIELDS)
# a valid request for either route, with at most two of its fields drawn as above: most get past
# the parser, so the methods, budgets, stops and streams they choose are served for real
VALID = st.fixed_dictionaries({
    "model": st.just(MODEL),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                "content": st.text(min_size=1, max_size=30)}), min_size=1, max_size=2),
    "prompt": st.text(min_size=1, max_size=30),
    "max_tokens": st.integers(1, 4),
}, optional={
    "temperature": st.floats(0, 2), "seed": st.integers(0, 2**32), "stream": st.booleans(),
    "stop": st.text(min_size=1, max_size=3), "method": st.sampled_from(list(METHODS)),
    "budget": st.integers(40, 200), "ratio": st.floats(0.1, 0.9),
})
ONE_FIELD = st.sampled_from(sorted(FIELDS)).flatmap(lambda k: FIELDS[k].map(lambda v: {k: v}))
NEAR = st.builds(lambda base, bad: {**base, **{k: v for d in bad for k, v in d.items()}}, VALID,
                 st.lists(ONE_FIELD, max_size=2))
RAW = st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode),
                st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n))


def _post(base: str, path: str, data: bytes) -> tuple[int, bytes, str]:
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers.get("Content-Type", "")


def _well_formed(status: int, raw: bytes, ctype: str, path: str) -> None:
    """An OpenAI-format answer: a completion (or its event stream) or a one-line 4xx error."""
    assert status < 500, (status, raw[:500])
    if status != 200:
        err = json.loads(raw)["error"]
        assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"], err
        assert isinstance(err["type"], str)
        return
    if ctype.startswith("text/event-stream"):
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", raw[-300:]
        for e in events[:-1]:
            chunk = json.loads(e)
            assert "error" not in chunk, chunk
        return
    body = json.loads(raw)
    choice = body["choices"][0]
    text = choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]
    assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["total_tokens"] >= body["usage"]["completion_tokens"] >= 0


def test_request_bodies_are_answered_or_refused_with_one_line(smollm2, tmp_path) -> None:
    """Bodies drawn over JSON shapes and types (and raw bytes: not JSON, not UTF-8, nested
    200,000 deep) to both completion routes: never a 5xx, never a malformed answer, and the
    server is as consistent after them as before (nothing busy, every context accounted for)."""
    app = App(config(smollm2, tmp_path / "state", n_ctx=256, max_tokens=4, defaults=Settings("knorm", 128)))
    seen: dict[int, int] = {}
    with running(app) as base:

        @settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), st.one_of(NEAR, NEAR, BODY, RAW))
        def post(path: str, body) -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            status, raw, ctype = _post(base, path, data)
            seen[status] = seen.get(status, 0) + 1
            _well_formed(status, raw, ctype, path)

        post()
        with urllib.request.urlopen(base + "/v1/edgekv/stats", timeout=30) as r:
            snap = json.load(r)
        assert all(c["state"] != "busy" for c in snap["conversations"]) and snap["totals"]["active_requests"] == 0
        live = {c["id"]: c["cells"] for c in snap["conversations"] if c["live"]}
        assert live == engine_view(app) and len(live) + len(app.store._spare) <= app.cfg.max_live
        status, raw, ctype = _post(base, "/v1/chat/completions", json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}).encode())
        assert status == 200
    print("statuses", seen)
    assert seen.get(200, 0) >= 20 and sum(v for k, v in seen.items() if 400 <= k < 500) >= 50, seen
