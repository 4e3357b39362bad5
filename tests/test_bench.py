"""The benchmark suite: task generators, scoring, the text source, and a tiny
end-to-end sweep (quality + speed + report) on the real default model."""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import numpy as np
import pytest
from _helpers import KL_NOISE, next_token_kl

from edgekv.bench import scoring, tasks
from edgekv.errors import EdgekvError


@pytest.fixture(scope="module", autouse=True)
def austen_text():
    """The haystack text (Debian's r-cran-janeaustenr); unpacked into the cache if not installed."""
    from edgekv.bench import text

    if not text.available():
        try:
            text.fetch()
        except EdgekvError as e:  # pragma: no cover - depends on the machine
            pytest.skip(f"benchmark text unavailable: {e}")
    return text


def words(s: str) -> int:
    return len(s.split())


# ---------------------------------------------------------------------------
# text source


def test_austen_text_is_read_without_r(austen_text) -> None:
    b = austen_text.books()
    assert set(b) == set(austen_text.BOOKS)
    assert b["emma"][0].startswith("Emma Woodhouse, handsome, clever, and rich")
    assert b["prideprejudice"][0].startswith("It is a truth universally acknowledged")
    assert sum(len(p.split()) for ps in b.values() for p in ps) > 600_000
    assert not any("_" in p for p in b["emma"][:200])  # italics marks are stripped
    sents = austen_text.sentences()
    assert len(sents) > 20_000 and not any(s.endswith(" Mr.") for s in sents[:5000])


def test_r_reader_parses_a_crafted_serialisation() -> None:
    import struct

    from edgekv.bench.text import _unserialize

    def i(v: int) -> bytes:
        return struct.pack(">i", v)

    def charsxp(s: str) -> bytes:
        b = s.encode()
        return i(9 | (64 << 12)) + i(len(b)) + b

    # list(a = c("x", NA), b = 1:2) as XDR version 3.
    names = i(16) + i(2) + charsxp("a") + charsxp("b")
    attr = i(2 | (1 << 10)) + i(1) + charsxp("names") + names + i(254)
    body = (i(19 | (1 << 9)) + i(2) + i(16) + i(2) + charsxp("x") + i(9) + i(-1)
            + i(13) + i(2) + i(1) + i(2) + attr)
    blob = b"X\n" + i(3) + i(0x040202) + i(0x030500) + i(5) + b"UTF-8" + body
    assert _unserialize(blob) == {"a": ["x", None], "b": [1, 2]}
    with pytest.raises(EdgekvError):
        _unserialize(b"A\n" + blob[2:])


# ---------------------------------------------------------------------------
# generators


@pytest.mark.parametrize("task", tasks.TASKS)
def test_generators_are_deterministic(task: str) -> None:
    a = tasks.make_sample(task, 1024, 7, 3, words)
    b = tasks.make_sample(task, 1024, 7, 3, words)
    assert a == b
    assert tasks.build_prompt(a) == tasks.build_prompt(b)
    # Another seed or index gives another sample.
    assert tasks.make_sample(task, 1024, 8, 3, words).context != a.context
    assert tasks.make_sample(task, 1024, 7, 4, words).context != a.context


@pytest.mark.parametrize("task", ["passkey", "niah_single", "niah_multikey", "niah_multivalue"])
@pytest.mark.parametrize("length", [512, 2048])
def test_needle_answers_appear_exactly_once(task: str, length: int) -> None:
    for i in range(5):
        s = tasks.make_sample(task, length, 0, i, words)
        assert s.answers and len(set(s.answers)) == len(s.answers)
        for ans in s.answers:
            assert len(re.findall(rf"(?<!\d){ans}(?!\d)", s.body)) == 1, (task, i, ans)
            assert ans not in s.question + s.answer_prefix
        # Whole prompt within the length, answer budget included.
        p = tasks.build_prompt(s)
        assert words(p.context) + words(p.query) + s.max_new_tokens <= length
        assert words(p.context) > 0.7 * length
        if task == "niah_multikey":  # the distractors are there, with their own numbers
            assert all(f"numbers for {k} is:" in s.body for k in s.meta["keys"])
        if task != "passkey":
            assert all(0.0 <= d <= 1.0 for d in s.meta["depths"])


def test_variable_tracking_chain_is_complete_and_unique() -> None:
    for i in range(5):
        s = tasks.make_sample("vt", 1024, 0, i, words)
        value = s.meta["value"]
        assert len(re.findall(rf"(?<!\d){value}(?!\d)", s.body)) == 1
        assert len(s.answers) == s.meta["hops"] + 1
        first, *rest = s.answers
        assert s.body.count(f"VAR {first} = {value}.") == 1
        prev = first
        for v in rest:  # each variable is assigned exactly once, from the previous one, in order
            assert len(re.findall(rf"VAR {v} =", s.body)) == 1
            assert s.body.index(f"VAR {v} = VAR {prev}.") > s.body.index(f"VAR {prev} =")
            prev = v


def test_common_words_frequencies() -> None:
    for length in (1024, 4096):
        s = tasks.make_sample("cwe", length, 0, 0, words)
        entries = re.findall(r"\d+\. ([a-z]+)", s.context)
        counts = Counter(entries)
        assert [n for n in range(1, len(entries) + 1)] == [int(x) for x in re.findall(r"(\d+)\. ", s.context)]
        for w in s.answers:
            assert counts[w] == s.meta["freq_cw"]
        others = [c for w, c in counts.items() if w not in s.answers]
        assert others and max(others) == s.meta["freq_ucw"] < s.meta["freq_cw"]


def test_ppl_sample_is_a_contiguous_passage(austen_text) -> None:
    s = tasks.make_sample("ppl", 1024, 0, 0, words)
    paras = austen_text.books()[s.meta["book"]]
    assert s.context.startswith(paras[s.meta["paragraph"]])
    assert words(s.context) >= 1024 + s.meta["eval_tokens"]


def test_query_aware_and_chat_prompts() -> None:
    s = tasks.make_sample("niah_single", 1024, 0, 0, words)
    agn = tasks.build_prompt(s)
    aware = tasks.build_prompt(s, query_aware=True)
    assert s.question not in agn.context and s.question in agn.query
    # query-aware: the question ends the compressed context, only the answer prefix follows
    assert aware.context.endswith(s.question) and s.question not in aware.query
    assert aware.context.startswith(agn.context) and aware.query.endswith(s.answer_prefix)
    chat = tasks.build_prompt(s, frame=("<user>", "</user><assistant>"))
    assert chat.context.startswith("<user>") and chat.query.endswith("</user><assistant>" + s.answer_prefix)


def test_bad_task_and_length() -> None:
    with pytest.raises(EdgekvError, match="unknown task"):
        tasks.make_sample("nope", 1024, 0, 0, words)
    with pytest.raises(EdgekvError, match="too short"):
        tasks.make_sample("vt", 64, 0, 0, words)


# ---------------------------------------------------------------------------
# scoring


@pytest.mark.parametrize(("task", "refs", "pred", "want"), [
    ("passkey", ("12345",), " 12345.", 1.0),
    ("passkey", ("12345",), " 54321.", 0.0),
    ("passkey", ("12345",), " 123456", 0.0),  # the answer inside a longer number is wrong
    ("passkey", ("12345",), " 11111 or 12345", 0.0),  # the first number given counts
    ("passkey", ("12345",), " a secret", 0.0),
    ("niah_single", ("9479738",), " 9479738.", 1.0),
    ("niah_single", ("9479738",), " 947.", 0.0),
    ("niah_multikey", ("5428250",), " 6407701.", 0.0),  # a distractor's number
    ("niah_multikey", ("5428250",), ": 5428250\n", 1.0),
    ("niah_multivalue", ("111", "222", "333", "444"), " 111, 222, 333 and 444.", 1.0),
    ("niah_multivalue", ("111", "222", "333", "444"), " 222 and 444", 0.5),
    ("niah_multivalue", ("111", "222", "333", "444"), " 1112, 2223", 0.0),
    ("vt", ("ABCDE", "FGHIJ", "KLMNO", "PQRST", "UVWXY"), " ABCDE, FGHIJ, KLMNO, PQRST, UVWXY", 1.0),
    ("vt", ("ABCDE", "FGHIJ", "KLMNO", "PQRST", "UVWXY"), " ABCDE, FGHIJ, XXXXX", 0.4),
    ("vt", ("ABCDE", "FGHIJ"), " ABCDEF", 0.0),
    ("cwe", ("party", "music", "garden", "letter"), " 1. Party 2. music 3. letters", 0.5),
    ("cwe", ("art",), " party", 0.0),
    ("cwe", ("party", "music"), "", 0.0),
])
def test_scoring(task: str, refs: tuple[str, ...], pred: str, want: float) -> None:
    assert scoring.score(task, pred, refs) == pytest.approx(want)


@pytest.mark.parametrize("length", [512, 2048])
def test_multiturn_sample_and_its_turns(length: int) -> None:
    """Four keyed needles, asked one per turn in an order of their own; every question and
    answer prefix of the later turns fits in the length with the first."""
    for i in range(5):
        s = tasks.make_sample("multiturn", length, 0, i, words)
        keys = s.meta["keys"]
        assert len(keys) == len(set(keys)) == len(s.answers) == tasks.MULTITURN_TURNS
        for k, ans in zip(keys, s.answers, strict=True):
            assert s.body.count(f"numbers for {k} is: {ans}.") == 1
            assert len(re.findall(rf"(?<!\d){ans}(?!\d)", s.body)) == 1
        frame, sep = ("<u>", "</u><a>"), "</a><u>"
        p = tasks.build_prompt(s, frame=frame)
        later = tasks.later_turns(s, frame, sep)
        assert [t.context for t in later] == [sep + q for q in s.meta["questions"][1:]]
        assert all(t.query == "</u><a>" + pre for t, pre in zip(later, s.meta["prefixes"][1:], strict=True))
        assert keys[0] in p.query and all(k in t.context for k, t in zip(keys[1:], later, strict=True))
        fed = words(p.context) + words(p.query) + sum(words(t.context + t.query) for t in later)
        assert fed + len(keys) * s.max_new_tokens <= length and words(p.context) > 0.5 * length


def test_kl_divergence_and_top1() -> None:
    rng = np.random.default_rng(1)
    a = np.stack([scoring.log_softmax(x) for x in rng.normal(size=(6, 40)) * 3])
    b = np.stack([scoring.log_softmax(x) for x in rng.normal(size=(6, 40)) * 3])
    assert scoring.kl_top1(a, a) == (0.0, 1.0)
    want = np.mean([sum(math.exp(p) * (p - q) for p, q in zip(ra, rb, strict=True)) for ra, rb in zip(a, b, strict=True)])
    kl, top1 = scoring.kl_top1(a, b)
    assert kl == pytest.approx(want, rel=1e-5) and kl > 0
    assert top1 == pytest.approx(np.mean(a.argmax(1) == b.argmax(1)))
    assert np.allclose(np.exp(a).sum(axis=1), 1.0, atol=1e-5)


def test_log_softmax_and_perplexity() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=50).astype(np.float32) * 10
    ref = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    for t in (0, 7, 49):
        assert scoring.log_softmax_at(logits, t) == pytest.approx(ref[t], abs=1e-5)
    assert scoring.perplexity(2 * math.log(3.0), 2) == pytest.approx(3.0)


def test_the_pareto_frontier_keeps_what_nothing_cheaper_beats() -> None:
    from edgekv.bench.report import Frontier, Point

    pts = [Point(8.0, 70.0, "f16", "full", 0.0), Point(4.0, 69.0, "q8_0", "full", 0.0),
           Point(4.0, 30.0, "f16", "lagkv", 0.5), Point(2.0, 60.0, "q4_0", "full", 0.0),
           Point(2.0, 20.0, "q8_0", "lagkv", 0.5), Point(1.0, 10.0, "q4_0", "lagkv", 0.5),
           Point(1.0, 5.0, "f16", "lagkv", 0.875)]
    best = Frontier(pts).best
    assert [(p.mib, p.qa) for p in best] == [(1.0, 10.0), (2.0, 60.0), (4.0, 69.0), (8.0, 70.0)]
    # every point has a frontier point with as few bytes and as high an average
    for p in pts:
        assert any(q.mib <= p.mib and q.qa >= p.qa for q in best)


def test_grid_plan_and_resume_keys(tmp_path) -> None:
    from edgekv.bench.runner import Grid, _evals, load_rows, plan, row_key

    g = Grid(tasks=["niah_single", "ppl"], n=3, n_ppl=1, methods=["full", "knorm"], ratios=[0.5, 0.75])
    # Sample-major: a sweep stopped early has every task.
    assert [(t, i) for _, _, _, t, i in plan(g)] == [("niah_single", 0), ("ppl", 0), ("niah_single", 1),
                                                    ("niah_single", 2)]
    assert _evals(g.method_names(), g.ratios) == [("full", 0.0), ("knorm", 0.5), ("knorm", 0.75)]
    with pytest.raises(EdgekvError, match="unknown method"):
        Grid(methods=["nope"]).validate()
    with pytest.raises(EdgekvError, match="ratios"):
        Grid(ratios=[1.5]).validate()
    # K/V apart: only a quantised V needs flash attention
    Grid(cache_types=["q8_0/f16"], flash_attn="off").validate()
    with pytest.raises(EdgekvError, match=r"quantised V cache \(q8_0\) needs flash attention"):
        Grid(cache_types=["f16/q8_0"], flash_attn="off").validate()
    base = {"model": "m", "cache_type": "f16", "task": "vt", "length": 1024, "seed": 0, "protocol": "agnostic",
            "template": "chat", "sample": 3, "method": "knorm", "ratio": 0.5}
    assert row_key(base) != row_key({**base, "ratio": 0.75}) != row_key({**base, "cache_type": "q8_0"})
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps(base) + "\n\n" + '{"torn": ')
    assert load_rows(f) == [base]


# ---------------------------------------------------------------------------
# end to end on the real default model


@pytest.mark.slow
def test_a_sweep_without_its_calibration_stops_before_any_row(smollm2_path, tmp_path, monkeypatch) -> None:
    # a fresh machine has no CompressKV profile: the sweep must say so at once, not write
    # hours of error rows that a resumed run would then take as done
    import edgekv.profiles
    from edgekv.bench.runner import RESULTS_FILE, Grid, load_rows, run_quality

    monkeypatch.setattr(edgekv.profiles, "profile_path", lambda sha: tmp_path / "none" / f"{sha}.json")
    monkeypatch.setattr(edgekv.profiles, "shipped_profile_path", lambda sha: None)  # a model edgekv ships none for
    grid = Grid(models=[str(smollm2_path)], methods=["full", "compresskv"], ratios=[0.5], lengths=[384],
                tasks=["niah_single"], n=1, eval_tokens=8, threads=1, out=tmp_path)
    with pytest.raises(EdgekvError, match="no CompressKV profile .*edgekv calibrate"):
        run_quality(grid, log=lambda s: None)
    assert load_rows(tmp_path / RESULTS_FILE) == []


def test_tiny_sweep_end_to_end(smollm2_path, tmp_path) -> None:
    from typer.testing import CliRunner

    from edgekv.bench.cli import bench_app
    from edgekv.bench.report import write_report
    from edgekv.bench.runner import RESULTS_FILE, Grid, load_rows, run_quality
    from edgekv.bench.speed import SpeedGrid, run_speed

    grid = Grid(models=[str(smollm2_path)], methods=["full", "knorm"], ratios=[0.5], lengths=[384],
                tasks=["niah_single", "multiturn", "ppl"], n=2, eval_tokens=8, threads=1, out=tmp_path)
    path = run_quality(grid, log=lambda s: None)
    rows = load_rows(path)
    assert len(rows) == 3 * 2 * 2  # tasks x samples x (full + knorm@0.5)
    for r in rows:
        assert r["score"] is not None and r["prompt_tokens"] > (100 if r["task"] == "multiturn" else 250)
        if r["method"] == "knorm":
            assert r["cells"] == r["prompt_tokens"] // 2 and r["kv_bytes"] < r["prompt_tokens"] * 1e5
        if r["task"] == "ppl":
            assert 1.0 < r["score"] < 1e4 and r["n_eval"] == 8
            if r["method"] == "full":  # the reference is the full cache itself
                assert (r["kl"], r["top1"]) == (0.0, 1.0)
            else:
                assert r["kl"] > 0 and 0.0 <= r["top1"] <= 1.0
        elif r["task"] == "multiturn":
            assert len(r["turn_scores"]) == len(r["answers"]) == len(r["output"]) == 4
            assert r["score"] == pytest.approx(sum(r["turn_scores"]) / 4)
        else:
            assert r["score"] in (0.0, 1.0) and r["answers"]
    # The full cache finds a needle at this length.
    assert any(r["score"] == 1.0 for r in rows if r["task"] == "niah_single" and r["method"] == "full")
    # Resumable: a second run adds nothing; a torn last line is ignored.
    with open(path, "a") as f:
        f.write('{"model": "torn')
    run_quality(grid, log=lambda s: None)
    assert len(load_rows(path)) == len(rows)
    # ppl rows from before KL was measured are measured again; the report takes the new ones
    stale = [r for r in rows if r["task"] == "ppl" and r["method"] == "knorm"]
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if not (r in stale and k in ("kl", "top1"))})
                            + "\n" for r in rows))
    run_quality(grid, log=lambda s: None)
    again = load_rows(path)
    assert len(again) == len(rows) + 2
    assert [r["kl"] for r in again[-2:]] == pytest.approx([r["kl"] for r in stale], rel=1e-3)

    sp = run_speed(SpeedGrid(models=[str(smollm2_path)], methods=["full", "knorm"], ratio=0.5, lengths=[256],
                             decode_tokens=4, stream=True, threads=1, out=tmp_path), log=lambda s: None)
    srows = load_rows(sp)
    modes = {(r["mode"], r["method"]) for r in srows}
    assert modes == {("oneshot", "full"), ("oneshot", "knorm"), ("stream", "knorm")}
    for r in srows:
        assert r["decode_tok_s"] > 0 and r["kv_bytes"] > 0
    knorm = next(r for r in srows if (r["mode"], r["method"]) == ("oneshot", "knorm"))
    assert knorm["cells"] == 128 and knorm["fresh_decode_tok_s"] > 0  # the fresh context it is compared with
    md, plots = write_report(tmp_path)
    text = md.read_text()
    assert "| knorm | 0.5 |" in text and "NIAH-1" in text and "PPL" in text and "decode tok/s" in text
    assert "| KL | top-1 % |" in text and "| MT |" in text and "accuracy % per turn" in text
    assert {p.name.split("_")[0] for p in plots} == {"accuracy", "decode"}
    assert all(p.stat().st_size > 1000 for p in plots)

    res = CliRunner().invoke(bench_app, ["report", str(tmp_path)])
    assert res.exit_code == 0 and "knorm" in res.output
    res = CliRunner().invoke(bench_app, ["quality", "--tasks", "nope", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "unknown task" in res.output
    assert json.loads((tmp_path / "grid.json").read_text())["methods_resolved"] == ["full", "knorm"]
    assert (tmp_path / RESULTS_FILE).is_file()


def test_a_sweep_quantises_k_and_v_apart(smollm2_path, tmp_path) -> None:
    from edgekv.bench.report import write_report
    from edgekv.bench.runner import Grid, load_rows, run_quality
    from edgekv.gguf_info import kv_bytes_per_token, read_model_info

    grid = Grid(models=[str(smollm2_path)], methods=["full"], lengths=[384], tasks=["niah_single"], n=1,
                eval_tokens=8, threads=1, cache_types=["f16", "q8_0/f16"], out=tmp_path)
    rows = {r["cache_type"]: r for r in load_rows(run_quality(grid, log=lambda s: None))}
    info = read_model_info(smollm2_path)
    for ct, k in (("f16", "f16"), ("q8_0/f16", "q8_0")):
        # a V cache in f16 runs without flash attention (edgekv's auto on the CPU), whatever K is
        assert rows[ct]["flash_attn"] == "off" and rows[ct]["score"] is not None
        assert rows[ct]["kv_bytes"] == rows[ct]["cells"] * kv_bytes_per_token(info, k, "f16")
    assert rows["q8_0/f16"]["kv_bytes"] < rows["f16"]["kv_bytes"]
    _, plots = write_report(tmp_path)
    assert any("_q8_0-f16_" in p.name for p in plots)


@pytest.mark.slow
@pytest.mark.kernels
@pytest.mark.parametrize("fa", ["on", "off"])
def test_batched_scoring_matches_token_by_token(smollm2, fa: str) -> None:
    """ppl scores a whole continuation in one batch; it must equal feeding it token by token.

    Without flash attention llama.cpp's CPU matmul takes another kernel for part of
    a batch, and the logits move by up to about 0.7 (KL up to 2e-3 nats on the AVX-512
    kernels, 4e-3 on the AVX2 ones: rounding noise, ``KL_NOISE``); an off-by-one in the
    batch's positions or logits gives a KL of 8.3 nats or more. With it the two were
    bit-identical on both x86 kernel sets, but only because 12 queries stay under
    ggml's flash-attention tile and x86 repacks no Q8_0 weights, so that is not asserted."""
    from edgekv.bench.runner import feed_logits
    from edgekv.session import Session

    toks = smollm2.tokenize("Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy "
                            "disposition, seemed to unite some of the best blessings of existence. " * 3)
    ctx, ev = toks[:40], toks[40:52]
    with Session(smollm2, method="full", n_ctx=128, chunk=64, n_threads=1, flash_attn=fa) as s:
        s.feed(ctx)
        saved = s.save()
        batched = [lg.copy() for lg in feed_logits(s, ev)]
        assert s.n_past == len(ctx) + len(ev) and s.engine.n_cells == s.n_past
        s.restore(saved)
        single = []
        for t in ev:
            s.feed([t])
            single.append(s.logits())
    for a, b in zip(batched, single, strict=True):
        assert next_token_kl(b, a) < KL_NOISE


def test_every_bench_script_is_reachable_from_one_entry_and_documented(capsys) -> None:
    """``edgekv bench list`` names every script in bench/, ``edgekv bench run NAME`` runs it
    with its own arguments, and bench/README.md gives each one its command."""
    from typer.testing import CliRunner

    from edgekv.bench.cli import bench_app
    from edgekv.bench.scripts import SCRIPTS, run, scripts

    names = sorted(p.stem for p in SCRIPTS.glob("*.py"))
    assert len(names) >= 20 and sorted(scripts()) == names
    res = CliRunner().invoke(bench_app, ["list"])
    assert res.exit_code == 0 and [line.split()[0] for line in res.output.splitlines()] == names
    readme = (SCRIPTS / "README.md").read_text()
    missing = [n for n in names if f"edgekv bench run {n}" not in readme]
    assert not missing, f"bench/README.md gives no command for {missing}"
    # a script's own parser answers, under the entry's name, before it loads anything
    assert run("passkey", ["--help"]) == 0
    assert "usage: edgekv bench run passkey" in capsys.readouterr().out
    assert run("passkey", ["--no-such-option"]) == 2
    res = CliRunner().invoke(bench_app, ["run", "nope"])
    assert res.exit_code == 2 and "no benchmark 'nope'; one of: ab_commits, ab_compress, attention_cost" in res.output
