"""End-to-end tests of the `edgekv` command line.

Every test runs the real console script in a subprocess on the real default
model (SmolLM2-135M Q4_1, pulled once by the ``smollm2_path`` fixture); nothing
is mocked. The error-path tests check the CLI's contract: a user mistake is
exactly one ``edgekv: error:`` line on stderr and exit code 2, never a
traceback or a crash.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib
import io
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from _helpers import run_cli


def assert_one_line_error(r: subprocess.CompletedProcess, *expect: str) -> str:
    """Exit 2, one ``edgekv: error:`` line on stderr, nothing else; returns the message."""
    ctx = f"rc={r.returncode}\nstdout={r.stdout!r}\nstderr={r.stderr!r}"
    assert "Traceback" not in r.stderr, ctx
    assert r.returncode == 2, ctx
    lines = r.stderr.splitlines()
    assert len(lines) == 1, ctx
    assert lines[0].startswith("edgekv: error: "), ctx
    assert r.stdout == "", ctx
    for e in expect:
        assert e.lower() in lines[0].lower(), ctx
    return lines[0]


def help_text(out: str) -> str:
    """Rich help panels as plain prose: box drawing removed, whitespace collapsed."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", out).split())


# ---------------------------------------------------------------------------
# bad input: one line, exit 2


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, smollm2_path: Path) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad_models")
    (d / "dir.gguf").mkdir()
    (d / "empty.gguf").write_bytes(b"")
    (d / "text.gguf").write_text("this is a text file, not a model\n")
    with open(smollm2_path, "rb") as f:
        (d / "truncated.gguf").write_bytes(f.read(2 * 1024 * 1024))

    import gguf

    w = gguf.GGUFWriter(str(d / "notanarch.gguf"), "notanarch")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _duplicate_a_token(smollm2_path, d / "duptoken.gguf")
    return {
        "duptoken": d / "duptoken.gguf",
        "missing": d / "no-such-model.gguf",
        "dir": d / "dir.gguf",
        "empty": d / "empty.gguf",
        "text": d / "text.gguf",
        "truncated": d / "truncated.gguf",
        "notanarch": d / "notanarch.gguf",
    }


def _duplicate_a_token(src: Path, dst: Path) -> None:
    """The default model with one token's string overwritten by another of the same length:
    the mutation that made llama.cpp abort the whole process (GGML_ASSERT in llama-vocab.cpp)."""
    import struct

    import gguf

    field = gguf.GGUFReader(src).fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]) for i in field.data[1000:1400]]
    a, b = next((x, y) for i, x in enumerate(tokens) for y in tokens[i + 1:] if len(x) == len(y) > 3)
    data = bytearray(src.read_bytes())
    at = data.index(struct.pack("<Q", len(a)) + a, data.index(b"tokenizer.ggml.tokens")) + 8
    data[at : at + len(a)] = b
    dst.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "kind, expect",
    [
        ("duptoken", "twice"),
        ("missing", "neither a file nor a known model"),
        ("dir", "directory"),
        ("empty", "empty"),
        ("text", "not a GGUF file"),
        ("truncated", "truncated"),
        ("notanarch", "unknown model architecture: 'notanarch'"),
    ],
)
def test_bad_model_file(bad_models, kind, expect):
    r = run_cli("generate", bad_models[kind], "--prompt", "hi", "--max-tokens", "1")
    assert_one_line_error(r, expect)


@pytest.mark.parametrize("kind", ["missing", "truncated", "text", "duptoken"])
def test_info_bad_model_file(bad_models, kind):
    assert_one_line_error(run_cli("info", bad_models[kind]))


GEN = ["generate", "--prompt", "hi", "--max-tokens", "1"]


@pytest.mark.parametrize(
    "args, expect",
    [
        pytest.param([*GEN, "--method", "nosuch"], ["unknown method 'nosuch'"], id="unknown-method"),
        pytest.param([*GEN, "--method", "knorm", "--param", "nope=1"], ["no parameter 'nope'"], id="unknown-param"),
        pytest.param([*GEN, "--method", "knorm", "--param", "nope"], ["NAME=VALUE"], id="param-syntax"),
        pytest.param([*GEN, "--method", "knorm", "--param", "sinks=-3"], ["sinks must be a whole number >= 0"],
                     id="negative-sinks"),
        pytest.param([*GEN, "--method", "snapkv", "--param", "window=-1"], ["window must be a whole number >= 0"],
                     id="negative-window"),
        pytest.param([*GEN, "--budget", "256", "--n-ctx", "256"], ["--budget 256", "--n-ctx 256"], id="budget>=n_ctx"),
        pytest.param([*GEN, "--method", "knorm", "--budget", "20"], ["--budget 20", "sinks", "window"], id="budget<protected"),
        pytest.param([*GEN, "--ratio", "1.5"], ["--ratio", "1.5"], id="ratio>1"),
        pytest.param([*GEN, "--budget", "100", "--ratio", "0.5"], ["--budget or --ratio"], id="budget+ratio"),
        pytest.param([*GEN, "--cache-type-k", "q3_k"], ["q3_k"], id="bad-cache-type"),
        pytest.param([*GEN, "--cache-type-v", "q8_0", "--flash-attn", "off"], ["flash attention"], id="quant-v-no-fa"),
        pytest.param([*GEN, "--flash-attn", "maybe"], ["--flash-attn", "maybe"], id="bad-fa"),
        pytest.param(["generate", "--prompt-file", "/nonexistent/prompt.txt"], ["does not exist"], id="missing-prompt-file"),
        pytest.param(["generate", "--prompt", ""], ["empty"], id="empty-prompt"),
        pytest.param(["generate", "--prompt", "  \n "], ["empty"], id="blank-prompt"),
        pytest.param(["generate"], ["exactly one of --prompt or --prompt-file"], id="no-prompt"),
        pytest.param(["generate", "--prompt", "hi", "--prompt-file", __file__], ["exactly one"], id="both-prompts"),
        pytest.param([*GEN, "--stats-json", "/nonexistent/dir/s.json"], ["--stats-json"], id="stats-json-dir"),
        pytest.param(["models", "pull", "nosuchmodel"], ["unknown model 'nosuchmodel'"], id="pull-unknown"),
        pytest.param(["info", "/nonexistent/model.gguf"], ["neither a file nor a known model"], id="info-missing"),
        pytest.param(["chat", "--method", "nosuch"], ["unknown method"], id="chat-unknown-method"),
        pytest.param([*GEN, "--question", " "], ["question is empty"], id="empty-question"),
        pytest.param([*GEN, "--method", "snapkv", "--param", "kernel=4"], ["kernel must be odd"], id="snapkv-even-kernel"),
        pytest.param([*GEN, "--method", "compresskv", "--param", "profile=/nonexistent/p.json"],
                     ["no CompressKV profile", "edgekv calibrate"], id="compresskv-no-profile"),
        pytest.param(["calibrate", "--lengths", "inf"], ["--lengths"], id="calibrate-bad-lengths"),
        pytest.param(["calibrate", "--depths", "1.5"], ["--depths in [0, 1]"], id="calibrate-bad-depths"),
        pytest.param(["calibrate", "--needles", "4"], ["--needles"], id="calibrate-bad-needles"),
        # typer-level usage errors follow the same one-line contract
        pytest.param([*GEN, "--budget", "abc"], ["--budget"], id="budget-not-int"),
        pytest.param([*GEN, "--no-such-option"], ["--no-such-option"], id="unknown-option"),
        pytest.param(["nosuchcommand"], ["nosuchcommand"], id="unknown-command"),
    ],
)
def test_bad_input_is_one_line(args, expect):
    assert_one_line_error(run_cli(*args), *expect)


def test_prompt_file_is_directory(tmp_path):
    assert_one_line_error(run_cli("generate", "--prompt-file", tmp_path), "directory")


# ---------------------------------------------------------------------------
# long prompts under a memory bound


def long_english_text(n_chars: int = 5400) -> str:
    """~1300 tokens of real English prose that ships with Python: the Zen of
    Python (the ``this`` module, ROT13-decoded) followed by the docstrings of
    heapq (François Pinard's essay on heaps), subprocess, tempfile, random,
    doctest and unittest, cut at a word boundary."""
    with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the Zen
        import this
    parts = [codecs.decode(this.s, "rot13")]
    for name in ("heapq", "subprocess", "tempfile", "random", "doctest", "unittest"):
        doc = importlib.import_module(name).__doc__
        if doc:
            parts.append(doc.strip())
    text = "\n\n".join(parts)
    assert len(text) >= n_chars, "stdlib docstrings missing (python -OO?)"
    text = text[:n_chars].rsplit(None, 1)[0]
    return text + "\n\nIn one sentence, the text above is about"


@pytest.fixture(scope="module")
def long_prompt(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("prompt") / "long.txt"
    p.write_text(long_english_text(), encoding="utf-8")
    return p


N_CTX = 256


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, mode",
    [
        ("knorm", ["--budget", "128"]),
        ("streaming_llm", ["--budget", "128"]),
        ("streaming_llm", ["--ratio", "0.5"]),
        ("chelsea", ["--budget", "128"]),
        ("protokv", ["--budget", "128"]),
    ],
    ids=["knorm-budget", "streaming_llm-budget", "streaming_llm-ratio", "chelsea-budget", "protokv-budget"],
)
def test_generate_long_prompt_bounded(smollm2_path, long_prompt, tmp_path, method, mode):
    stats = tmp_path / "stats.json"
    r = run_cli(
        "generate", "--prompt-file", long_prompt, "--n-ctx", N_CTX, *mode, "--method", method,
        "--max-tokens", "16", "--stats-json", stats, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout.strip(), "no text generated"
    s = json.loads(stats.read_text())
    assert s["capacity"] == N_CTX
    assert s["tokens_seen"] >= 4 * N_CTX, s["tokens_seen"]
    assert s["peak_cells"] <= N_CTX
    assert 1 <= s["cells"] <= N_CTX
    assert s["compressions"] >= 1
    assert len(s["events"]) == s["compressions"]
    assert s["tokens_evicted"] == sum(before - after for _, before, after in s["events"])
    for _, before, after in s["events"]:
        assert before <= N_CTX
        if mode[0] == "--budget":
            assert after == int(mode[1])
        else:  # --ratio R removes a fraction R of the cells present
            assert after == int(before * (1 - float(mode[1])))
    # The stats line on stderr agrees with the JSON.
    assert f"[cells {s['cells']}/{N_CTX} | seen {s['tokens_seen']} |" in r.stderr


QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "What is two plus two?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Give me a synonym for happy.",
    "What planet is closest to the sun?",
    "How many days are in a week?",
    "What language is spoken in Brazil?",
    "What is the largest ocean on Earth?",
    "Name a fruit that is yellow.",
    "What do bees make?",
    "How many continents are there?",
    "What is the opposite of cold?",
    "What gas do plants absorb from the air?",
    "What is the square root of nine?",
    "Which animal is known as the king of the jungle?",
    "What color is the sky on a clear day?",
    "Say goodbye in Spanish.",
]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["knorm", "chelsea"])
def test_chat_twenty_turns_bounded(smollm2_path, tmp_path, method):
    n_ctx = 320
    stats = tmp_path / "chat.json"
    r = run_cli(
        "chat", "--method", method, "--budget", "192", "--n-ctx", n_ctx, "--max-tokens", "24",
        "--temperature", "0", "--stats-json", stats,
        stdin="".join(q + "\n" for q in QUESTIONS), timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    s = json.loads(stats.read_text())
    turns = s["turns"]
    assert [t["user"] for t in turns] == QUESTIONS
    replies = [t["reply"] for t in turns]
    assert all(rep.strip() for rep in replies), replies
    # Non-interactive stdout is exactly the replies, one per turn, each ended by a newline.
    assert r.stdout == "".join(rep + "\n" for rep in replies)
    # One counter line per turn on stderr, each within the bound.
    stat_lines = r.stderr.splitlines()
    assert len(stat_lines) == len(QUESTIONS), r.stderr
    for line in stat_lines:
        m = re.match(rf"\[cells (\d+)/{n_ctx} \| seen (\d+) \|", line)
        assert m, line
        assert int(m.group(1)) <= n_ctx
    assert [int(re.match(r"\[cells (\d+)", ln).group(1)) for ln in stat_lines] == [t["cells"] for t in turns]
    assert s["compressions"] >= 1
    assert s["cells"] <= n_ctx and s["peak_cells"] <= n_ctx
    assert s["tokens_seen"] > n_ctx  # the conversation outgrew the cache
    assert turns[-1]["compressions"] == s["compressions"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["snapkv", "protokv"])
def test_chat_makes_room_between_turns(smollm2_path, tmp_path, method):
    """With --room, the compression a turn would wait for runs after the reply before it
    (while the user types): no turn compresses inside itself, and the cache stays as
    bounded. Without it, turns that fill the cache compress before their reply. (Methods
    with a schedule of their own, Chelsea's and LagKV's, still compress as it falls due.)"""
    n_ctx, questions = 320, QUESTIONS[:12]
    got = {}
    for room in (0, 96):
        stats = tmp_path / f"chat{room}.json"
        r = run_cli(
            "chat", "--method", method, "--budget", "128", "--n-ctx", n_ctx, "--max-tokens", "24",
            "--temperature", "0", "--stats-json", stats, "--room", room,
            stdin="".join(q + "\n" for q in questions), timeout=300,
        )
        assert r.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr
        got[room] = json.loads(stats.read_text())
        turns = got[room]["turns"]
        assert [t["user"] for t in turns] == questions and all(t["reply"].strip() for t in turns)
        assert got[room]["compressions"] >= 1 and got[room]["peak_cells"] <= n_ctx
    assert any(t["compressions_in_turn"] for t in got[0]["turns"])
    assert not any(t["compressions_in_turn"] for t in got[96]["turns"])
    # the room is kept after every reply, the last one too (the chat waits for it at the end)
    assert got[96]["cells"] + 96 <= n_ctx


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_a_room_as_large_as_the_context_is_one_line(smollm2_path, command):
    r = run_cli(command, "--method", "knorm", "--budget", "128", "--n-ctx", "256", "--room", "256", stdin="",
                timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == ["edgekv: error: --room 256 leaves no cells for the conversation: "
                                             "it must be below --n-ctx (256)"]


class _Chat:
    """``edgekv chat`` in a subprocess, its output read as it comes, for signals mid-turn."""

    def __init__(self, *args: object) -> None:
        import os
        import threading

        from _helpers import CMD

        env = dict(os.environ, COLUMNS="200", NO_COLOR="1", TERM="dumb", PYTHONUNBUFFERED="1")
        env.pop("EDGEKV_VERBOSE", None)
        import signal

        # A test run started in the background by a shell without job control inherits SIGINT
        # ignored, and Python then never turns it into KeyboardInterrupt: restore the default.
        self.p = subprocess.Popen([*CMD, "chat", *map(str, args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.p.stdout, self.out), (self.p.stderr, self.err)):
            threading.Thread(target=lambda s=stream, k=sink: k.extend(iter(lambda: s.read(1), "")),
                             daemon=True).start()

    def say(self, text: str) -> None:
        self.p.stdin.write(text + "\n")
        self.p.stdin.flush()

    def wait_for(self, what, timeout: float = 120) -> None:
        import time

        deadline = time.time() + timeout
        while not what():
            assert time.time() < deadline and self.p.poll() is None, ("".join(self.out), "".join(self.err))
            time.sleep(0.05)

    def finish(self) -> int:
        self.p.stdin.close()
        return self.p.wait(timeout=300)


def test_ctrl_c_stops_the_reply_and_keeps_the_conversation(tmp_path) -> None:
    """SIGINT mid-reply: the reply stops, its text so far is the assistant's turn, the chat
    goes on in the same cache; SIGINT mid-prefill drops that message and the next turn
    rebuilds the cache from the messages. Nothing is lost, the chat exits 0."""
    import signal

    stats = tmp_path / "chat.json"
    chat = _Chat("--method", "knorm", "--budget", "512", "--n-ctx", "1024", "--max-tokens", "400",
                 "--temperature", "0", "--stats-json", stats)
    chat.say("Write a very long story about a lighthouse keeper and her cat.")
    chat.wait_for(lambda: len("".join(chat.out)) > 40)
    chat.p.send_signal(signal.SIGINT)
    chat.wait_for(lambda: "(stopped)" in "".join(chat.err))
    chat.say("What was the cat's name?")
    chat.wait_for(lambda: len([ln for ln in "".join(chat.err).splitlines() if ln.startswith("[cells")]) >= 2)
    chat.say("The harbour log of the old town, day after day. " * 2000)  # a long prefill (22k tokens)...
    import time

    time.sleep(3)
    chat.p.send_signal(signal.SIGINT)  # ...stopped in the middle
    chat.wait_for(lambda: "that message is dropped" in "".join(chat.err))
    chat.say("Say hello.")
    chat.say("/quit")
    assert chat.finish() == 0, "".join(chat.err)
    err = "".join(chat.err)
    assert "Traceback" not in err
    turns = json.loads(stats.read_text())["turns"]
    assert [t["user"] for t in turns] == ["Write a very long story about a lighthouse keeper and her cat.",
                                          "What was the cat's name?", "Say hello."]
    first, second, third = (t["reply"] for t in turns)
    assert first.strip() and second.strip() and third.strip()
    assert first in "".join(chat.out)  # what was shown is what was kept
    assert turns[1]["tokens_seen"] > turns[0]["tokens_seen"] + 5  # the same cache went on
    # the rebuilt cache holds the three turns' messages again (the last reply: up to 400 tokens),
    # not the dropped message's 22000 or so
    assert turns[2]["tokens_seen"] < turns[1]["tokens_seen"] + 30 + 400


# ---------------------------------------------------------------------------
# listing commands and help


def test_methods_lists_all_with_params():
    r = run_cli("methods")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    from edgekv.methods import METHODS

    for name in ("full", "streaming_llm", "knorm", "random"):
        assert name in METHODS
        (i,) = [i for i, ln in enumerate(lines) if ln.split()[:1] == [name]]
        params = lines[i + 1].split("params:", 1)[1]
        expect = ", ".join(f"{k}={v}" for k, v in METHODS[name]().params().items())
        assert params.strip() == expect
        assert "sinks=" in params and "window=" in params
    assert "seed=" in lines[[ln.split()[:1] for ln in lines].index(["random"]) + 1]


def test_info_default_model(smollm2_path):
    r = run_cli("info")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert re.search(r"^layers\s+30\b", out, re.M), out
    assert "3 KV heads" in out
    assert re.search(r"head_dim k/v 64/64", out), out
    # f16 K + V, 30 layers x 3 KV heads x 64 dims x 2 bytes each
    m = re.search(r"^KV/token\s+f16 (\d+) B", out, re.M)
    assert m, out
    assert int(m.group(1)) == 2 * 30 * 3 * 64 * 2
    assert "engine:" in out


# ggml's feature names -> /proc/cpuinfo flags
CPU_FLAGS = {"SSE3": "pni", "SSSE3": "ssse3", "AVX": "avx", "AVX2": "avx2", "F16C": "f16c", "FMA": "fma",
             "BMI2": "bmi2", "AVX_VNNI": "avx_vnni", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
             "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16", "AMX_INT8": "amx_int8"}


def test_info_prints_the_cpu_features_llama_cpp_uses(smollm2_path):
    r = run_cli("info")
    assert r.returncode == 0, r.stderr
    m = re.search(r"^cpu features \(llama.cpp's kernels\): (.+)$", r.stdout, re.M)
    assert m, r.stdout
    listed = m.group(1).split()
    from edgekv.llama import system_info

    # the same set llama.cpp reports, and only instruction sets this CPU has
    assert listed == re.findall(r"([A-Z0-9_]+) = 1", system_info())
    flags = set(next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split())
    assert "AVX2" in listed or "avx2" not in flags or "AVX512" in listed
    for feat in listed:
        if feat in CPU_FLAGS:
            assert CPU_FLAGS[feat] in flags, f"llama.cpp reports {feat}, the CPU lacks {CPU_FLAGS[feat]}"


def test_models_list_shows_default_pulled(smollm2_path):
    r = run_cli("models", "list")
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines()]
    assert ["smollm2-135m", "pulled"] in [row[:2] for row in rows], r.stdout


def test_help():
    r = run_cli("--help")
    assert r.returncode == 0, r.stderr
    text = help_text(r.stdout)
    for cmd in ("chat", "generate", "methods", "info", "models"):
        assert re.search(rf"\b{cmd}\b", text), cmd


def test_chat_help_documents_budget_and_ratio():
    r = run_cli("chat", "--help")
    assert r.returncode == 0, r.stderr
    text = help_text(r.stdout)
    assert "--budget" in text and "--ratio" in text and "--stats-json" in text
    # what --budget counts
    assert "Cells to keep after each compression" in text
    assert "One cell = one cached token in every layer and KV head" in text
    # the --ratio convention: the fraction removed, kvpress-style
    assert "Fraction of cells REMOVED at each compression" in text
    assert "0.75 keeps 25 %" in text


@pytest.mark.slow
@pytest.mark.parametrize("method", ["snapkv", "chunkkv"])
def test_generate_question_is_compressed_with_the_prompt(smollm2_path, tmp_path, method):
    """Query-aware: the question ends the prompt, and the cache is brought to the budget
    after it, so the last compression saw the question in its observation window."""
    stats = tmp_path / "s.json"
    doc = tmp_path / "doc.txt"
    doc.write_text("The harbour master logged every ship, its flag and its cargo. " * 60)
    r = run_cli("generate", smollm2_path, "--prompt-file", doc, "--question", "What did the harbour master log?",
                "--method", method, "--budget", "160", "--n-ctx", "288", "--max-tokens", "8",
                "--stats-json", stats, timeout=300)
    assert r.returncode == 0, r.stderr
    s = json.loads(stats.read_text())
    last_seen, before, after = s["events"][-1]
    assert after == 160 and before > 160
    # generated tokens add cells after it (no later compression fits in n_ctx 288), so the
    # prompt was tokens_seen - (cells - 160) tokens: the last compression came right after it
    assert last_seen == s["tokens_seen"] - (s["cells"] - 160)


def test_import_loads_libllama_first_only_for_cuda_builds() -> None:
    # A CUDA build of libllama loaded after numpy crashed in the tokenizer on a GPU machine
    # (docs/backends.md): `import edgekv` loads such a build before anything imports numpy,
    # and leaves CPU builds unloaded so `edgekv --help` stays quick.
    import sys
    from importlib.util import find_spec

    lib = Path(next(iter(find_spec("llama_cpp").submodule_search_locations))) / "lib"
    cuda = any(lib.glob("libggml-cuda.*"))
    probe = "import sys, edgekv; print('llama_cpp.llama_cpp' in sys.modules, 'numpy' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert r.stdout.split() == [str(cuda), str(cuda)], r.stdout + r.stderr
