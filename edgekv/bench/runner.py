"""The quality sweep: models x cache types x context lengths x tasks x samples x methods x ratios.

Protocol (query-agnostic, the default; kvpress's "compress once, ask later"):
prefill the context, compress the cache to ``(1 - ratio)`` of its cells, then
feed the question and decode greedily. Each sample is prefilled once; the
sequence is saved and restored for every (method, ratio). ``query_aware``
ends the compressed context with the question (attention methods see it in
their observation window) and feeds only the answer prefix after.

The ppl task also compares every row's next-token distributions with the full
cache's over the same continuation (KL divergence, top-1 agreement); the
multiturn task asks a question per turn, compressing back to the first
compression's cells before each.

Methods that move positions (llama.cpp's context shift) cannot start from a
full prefill: they run as llama.cpp would, in a context of ``n_ctx`` = the
same number of cells the other methods keep, streaming the whole sample
through it (one prefill per ratio, so they cost more).

Every evaluation is one JSON line in ``results.jsonl``; a row whose key is
already there is skipped, so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import EdgekvError
from ..ggml_types import kv_kwargs, kv_types
from ..methods import Method, get_method
from . import protocol as evaluation
from . import scoring, tasks

RESULTS_FILE = "results.jsonl"
DEFAULT_RATIOS = (0.5, 0.75, 0.875, 0.9375)
SINGLE_ANSWER = ("passkey", "niah_single", "niah_multikey")
# The default grid (every method, 4 ratios, --n 20, SmolLM2-135M, 2 cores): hours; it resumes.
DEFAULT_TASKS = ("niah_single", "niah_multikey", "vt", "multiturn", "ppl")


@dataclass
class Grid:
    models: list[str | None] = field(default_factory=lambda: [None])
    methods: list[str] = field(default_factory=lambda: ["all"])
    ratios: list[float] = field(default_factory=lambda: list(DEFAULT_RATIOS))
    lengths: list[int] = field(default_factory=lambda: [1024])
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    cache_types: list[str] = field(default_factory=lambda: ["f16"])
    flash_attn: str = "auto"  # resolved per cache type (llama.resolve_flash_attn); recorded in every row
    n: int = 20
    n_ppl: int | None = None  # samples of the ppl task (default: n)
    n_shift: int | None = 2  # samples per task for position-shifting methods (one prefill per ratio); None: all
    seed: int = 0
    query_aware: bool = False
    chat: bool = True
    eval_tokens: int = 128
    threads: int | None = None
    out: Path = Path("bench/results")

    def method_names(self) -> list[str]:
        from ..methods import METHODS

        names: list[str] = []
        for m in self.methods:
            if m == "all":
                names += [n for n in METHODS if n not in names]
            elif m not in names:
                get_method(m)  # unknown names (and suffixes) are one-line errors
                names.append(m)
        return names

    def validate(self) -> None:
        for t in self.tasks:
            if t not in tasks.TASKS:
                raise EdgekvError(f"unknown task {t!r}; available: {', '.join(tasks.TASKS)}")
        for r in self.ratios:
            if not 0.0 < r < 1.0:
                raise EdgekvError(f"ratios are fractions removed, in (0, 1); got {r}")
        for n in self.lengths:
            if n < 256:
                raise EdgekvError(f"context length {n} is too short (minimum 256)")
        if self.n < 1:
            raise EdgekvError("--n must be at least 1")
        from ..llama import check_flash_attn

        for ct in self.cache_types:
            check_flash_attn(self.flash_attn, kv_types(ct)[1])
        self.method_names()


def row_key(r: dict) -> str:
    # Rows written before flash attention was recorded all ran with it on.
    return "|".join([*(str(r[k]) for k in ("model", "cache_type", "task", "length", "seed", "protocol", "template",
                                           "sample", "method", "ratio")), str(r.get("flash_attn", "on"))])


def load_rows(path: Path) -> list[dict]:
    """Rows of a results file; a torn last line (killed mid-write) is ignored."""
    rows = []
    if not path.is_file():
        return rows
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def model_label(arg: str | None, path: Path) -> str:
    from ..models import DEFAULT_MODEL, list_models

    if arg is None:
        return DEFAULT_MODEL
    if arg in {m.name for m in list_models()}:
        return arg
    return path.stem


def _evals(methods: list[str], ratios: list[float]) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    for m in methods:
        if not get_method(m).compresses:
            out.append((m, 0.0))
        else:
            out += [(m, r) for r in ratios]
    return out


def stop_rule(task: str) -> Callable[[str], bool]:
    """When an answer is complete: a number and what follows it, or a new line (single answers)."""
    if task in SINGLE_ANSWER or task == "multiturn":
        return lambda s: re.search(r"\d+\D", s) is not None or ("\n" in s.strip())
    return lambda s: False


def generate_answer(sess, max_new: int, stop: Callable[[str], bool]) -> str:
    """Greedy tokens until ``stop`` says the answer is complete (or ``max_new``), as text."""
    import codecs

    dec = codecs.getincrementaldecoder("utf-8")("replace")
    out = ""
    for tok in sess.generate_tokens(max_new):
        out += dec.decode(sess.model.piece(tok))
        if stop(out):
            break
    return out + dec.decode(b"", final=True)


@dataclass
class Prepared:
    sample: tasks.Sample
    prompt: tasks.Prompt | None
    tokens: list[int] | None  # ppl: context tokens; last one is fed after compression
    eval_tokens: list[int] | None
    turns: list[tasks.Prompt] = field(default_factory=list)  # multiturn: the turns after the first
    query_aware: bool = False
    reference: np.ndarray | None = None  # ppl: the full cache's log-probabilities over the continuation


def prepare(model, task: str, length: int, grid: Grid, index: int, frame, separator: str | None) -> Prepared:
    count = lambda s: len(model.tokenize(s, add_special=False))  # noqa: E731
    s = tasks.make_sample(task, length, grid.seed, index, count)
    if task == "ppl":
        toks = model.tokenize(s.context, add_special=True)
        return Prepared(s, None, toks[:length], toks[length : length + grid.eval_tokens])
    turns = tasks.later_turns(s, frame, separator) if task == "multiturn" else []
    return Prepared(s, tasks.build_prompt(s, query_aware=grid.query_aware, frame=frame), None, None, turns,
                    grid.query_aware)


def _reference(sess, prep: Prepared, pre: evaluation.Prefill) -> np.ndarray:
    """float32 [n_eval, n_vocab]: log-probabilities of the full cache over the ppl continuation,
    which every method's row is compared with (KL divergence, top-1 agreement)."""
    evaluation.compress_once(sess, pre, "full")
    inputs = [prep.tokens[-1], *prep.eval_tokens[:-1]]
    return np.stack([scoring.log_softmax(lg) for lg in feed_logits(sess, inputs)])


def run_oneshot(sess, prep: Prepared, method: str | Method, ratio: float, pre: evaluation.Prefill) -> dict:
    """The shared protocol (restore the prefilled context, compress once), then ask and score."""
    compress_s = evaluation.compress_once(sess, pre, method, ratio=ratio)
    cells = sess.engine.n_cells
    row = {"cells": cells, "kv_bytes": cells * sess.stats.kv_bytes_per_cell, "compress_s": round(compress_s, 4)}
    target = sess.rule.target(pre.n_cells) if ratio > 0 and sess.method.compresses else None
    row.update(_answer(sess, prep, target))
    return row


def _answer(sess, prep: Prepared, target: int | None = None) -> dict:
    """Ask (or continue) and score. ``target``: the cells a multi-turn conversation is compressed
    back to before each later turn (None: it is not, e.g. the full cache)."""
    t0 = time.perf_counter()
    if prep.sample.task == "ppl":
        targets = prep.eval_tokens
        inputs = [prep.tokens[-1], *targets[:-1]]
        logits = list(feed_logits(sess, inputs))
        nll = -sum(scoring.log_softmax_at(lg, t) for lg, t in zip(logits, targets, strict=True))
        n = len(targets)
        row = {"score": round(scoring.perplexity(nll, n), 4), "nll": round(nll / n, 5), "n_eval": n}
        if prep.reference is not None:
            kl, top1 = scoring.kl_top1(prep.reference, np.stack([scoring.log_softmax(lg) for lg in logits]))
            row.update(kl=round(kl, 6), top1=round(top1, 4))
        return {**row, "gen_s": round(time.perf_counter() - t0, 3)}
    s = prep.sample
    sess.feed_text(prep.prompt.query, add_special=False)
    out = generate_answer(sess, s.max_new_tokens, stop_rule(s.task))
    if s.task != "multiturn":
        return {"score": scoring.score(s.task, out, s.answers), "output": out.strip()[:200],
                "answers": list(s.answers), "gen_s": round(time.perf_counter() - t0, 3)}
    outs = [out]
    for turn in prep.turns:
        if prep.query_aware:
            sess.feed_text(turn.context, add_special=False)
        if target is not None and sess.engine.n_cells > target:
            sess.compress(target)
        sess.feed_text(turn.query if prep.query_aware else turn.context + turn.query, add_special=False)
        outs.append(generate_answer(sess, s.max_new_tokens, stop_rule("niah_single")))
    per_turn = [scoring.score("niah_single", o, (a,)) for o, a in zip(outs, s.answers, strict=True)]
    return {"score": sum(per_turn) / len(per_turn), "turn_scores": per_turn, "output": [o.strip()[:80] for o in outs],
            "answers": list(s.answers), "gen_s": round(time.perf_counter() - t0, 3)}


def feed_logits(sess, tokens: list[int]) -> Iterator[np.ndarray]:
    """Feed tokens and yield the logits after each one (what predicts the next token).

    One batch with logits at every position when it fits in the free cells
    and the batch (Session.feed keeps only the last logits); otherwise token
    by token through Session.feed, which compresses as needed.
    """
    ctx = sess.ctx
    n = len(tokens)
    if sess.engine.n_cells + n > sess.capacity or n > ctx.n_batch:
        for t in tokens:
            sess.feed([t])
            yield sess.logits()
        return
    sess.engine.decode(tokens, sess.n_past, all_logits=True)
    sess.n_past += n
    sess.stats.tokens_seen += n
    sess.stats.cells = sess.engine.n_cells
    sess._has_logits = True
    for i in range(n):
        yield ctx.logits(i)


def _run_streaming(model, grid: Grid, cache_type: str, prep: Prepared, method: str, ratio: float,
                   n_prompt: int) -> dict:
    """A position-shifting method at the same memory: n_ctx = the cells the others keep."""
    from ..session import Session

    n_ctx = max(64, math.floor(n_prompt * (1.0 - ratio)))
    chunk = max(8, min(256, n_ctx // 4))
    with Session(model, method=method, n_ctx=n_ctx, chunk=chunk, **kv_kwargs(cache_type),
                 flash_attn=grid.flash_attn, n_threads=grid.threads) as sess:
        t0 = time.perf_counter()
        if prep.sample.task == "ppl":
            sess.feed(prep.tokens[:-1])
        else:
            sess.feed_text(prep.prompt.context, add_special=True)
        prefill_s = time.perf_counter() - t0
        row = {"cells": sess.engine.n_cells, "kv_bytes": n_ctx * sess.stats.kv_bytes_per_cell,
               "compress_s": round(sess.stats.compress_seconds, 4), "stream_prefill_s": round(prefill_s, 3),
               "compressions": sess.stats.compressions}
        row.update(_answer(sess, prep))
    return row


class _Reporter:
    """Rich progress bars on a terminal; one line per sample otherwise (logs)."""

    def __init__(self, total: int, done: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = Console(stderr=True)
        self.tty = self.console.is_terminal
        self.total, self.done = total, done
        self.t0 = time.perf_counter()
        self.prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), TimeRemainingColumn(), console=self.console,
                             disable=not self.tty)
        self.task = self.prog.add_task("quality", total=total, completed=done)
        self.sub = self.prog.add_task("", total=1, visible=False)

    def __enter__(self) -> _Reporter:
        self.prog.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.prog.__exit__(*exc)

    def stage(self, text: str, total: int | None = None) -> None:
        self.prog.update(self.sub, description=text, total=total or 1, completed=0, visible=True)

    def advance_stage(self) -> None:
        self.prog.advance(self.sub)

    def advance(self, n: int, line: str | None = None) -> None:
        self.done += n
        self.prog.update(self.task, completed=self.done)
        if line and not self.tty:
            el = time.perf_counter() - self.t0
            print(f"[{self.done}/{self.total} {el:6.0f}s] {line}", file=sys.stderr, flush=True)


def plan(grid: Grid) -> Iterator[tuple[str | None, str, int, str, int]]:
    """Sample-major within each (model, cache type, length): a sweep stopped at any
    point has about as many samples of every task (it resumes from there)."""
    n_max = max(grid.n, grid.n_ppl or 0)
    for model in grid.models:
        for ct in grid.cache_types:
            for length in grid.lengths:
                for i in range(n_max):
                    for task in grid.tasks:
                        n = grid.n_ppl if (task == "ppl" and grid.n_ppl is not None) else grid.n
                        if i < n:
                            yield model, ct, length, task, i


def run_quality(grid: Grid, *, log: Callable[[str], None] | None = None) -> Path:
    """Run (or resume) the sweep; returns the results file."""
    from ..llama import Model, resolve_flash_attn
    from ..models import resolve_model
    from ..session import Session

    grid.validate()
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    grid.out.mkdir(parents=True, exist_ok=True)
    path = grid.out / RESULTS_FILE
    # ppl rows written before KL divergence was measured are measured again (the report takes the latest)
    done = {row_key(r) for r in load_rows(path) if not (r["task"] == "ppl" and r.get("score") is not None
                                                         and "kl" not in r)}
    methods = grid.method_names()
    # the prefill records the queries every attention method of the grid will read
    observe = max((get_method(m).queries_needed for m in methods), default=0)
    shifts = {m: get_method(m).shifts_positions for m in methods}
    tally = any(get_method(m).tallies for m in methods)
    moments = any(get_method(m).query_statistics for m in methods)
    scratch = max((get_method(m).scratch_cells for m in methods), default=0)  # KVzip's repeat pass
    evals = _evals(methods, grid.ratios)
    protocol = "aware" if grid.query_aware else "agnostic"
    template = "chat" if grid.chat else "raw"
    items = list(plan(grid))

    def evals_for(i: int) -> list[tuple[str, float]]:
        if grid.n_shift is None or i < grid.n_shift:
            return evals
        return [(m, r) for m, r in evals if not shifts[m]]

    total = sum(len(evals_for(it[-1])) for it in items)
    with open(grid.out / "grid.json", "w", encoding="utf-8") as f:
        json.dump({**{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(grid).items()},
                   "methods_resolved": methods, "environment": environment()}, f, indent=1)

    models: dict[str | None, tuple[Model, str]] = {}
    skipped = 0
    with _Reporter(total, 0) as rep, open(path, "a", encoding="utf-8") as out:
        sess = None
        sess_key = None
        try:
            for model_arg, ct, length, task, i in items:
                if model_arg not in models:
                    p = resolve_model(model_arg)
                    models[model_arg] = (Model(p), model_label(model_arg, p))
                    for m in methods:  # a missing calibration stops here, not as hours of error rows
                        get_method(m).attach(models[model_arg][0].info)
                model, label = models[model_arg]
                fa = resolve_flash_attn(grid.flash_attn, kv_types(ct)[1], model.n_gpu_layers)
                base = {"model": label, "cache_type": ct, "task": task, "length": length, "seed": grid.seed,
                        "protocol": protocol, "template": template, "sample": i, "flash_attn": fa}
                mine = evals_for(i)
                todo = [(m, r) for m, r in mine if row_key({**base, "method": m, "ratio": r}) not in done]
                if not todo:
                    rep.advance(len(mine))
                    continue
                n_train = model.arch.n_ctx_train or 0
                if n_train and length > n_train:
                    skipped += len(todo)
                    rep.advance(len(mine), f"skip {label} L={length} > trained context {n_train}")
                    continue
                key = (model_arg, ct, length)
                if sess_key != key:
                    if sess is not None:
                        sess.close()
                    sess = Session(model, method="full", n_ctx=length + grid.eval_tokens + 64 + scratch, chunk=512,
                                   **kv_kwargs(ct), flash_attn=grid.flash_attn,
                                   n_threads=grid.threads, observe=observe, tally=tally, moments=moments)
                    sess_key = key
                frame = tasks.chat_frame(model) if grid.chat and task != "ppl" else None
                sep = tasks.turn_separator(model) if grid.chat and task == "multiturn" else None
                prep = prepare(model, task, length, grid, i, frame, sep)
                rep.stage(f"{label} {ct} L={length} {task} #{i}: prefill", len(todo) + 1)
                ctx_tokens = (prep.tokens[:-1] if task == "ppl"
                              else model.tokenize(prep.prompt.context, add_special=True))
                pre = evaluation.prefill(sess, ctx_tokens)
                prefill_s, n_prompt = pre.seconds, pre.n_cells
                if task == "ppl":
                    prep.reference = _reference(sess, prep, pre)
                rep.advance_stage()
                summary = []
                for m, r in todo:
                    rep.stage(f"{label} {ct} L={length} {task} #{i}: {m}@{r}", len(todo) + 1)
                    row = {**base, "method": m, "ratio": r, "prompt_tokens": n_prompt,
                           "prefill_s": round(prefill_s, 3)}
                    try:
                        if shifts[m]:
                            row.update(_run_streaming(model, grid, ct, prep, m, r, n_prompt))
                        else:
                            row.update(run_oneshot(sess, prep, m, r, pre))
                    except EdgekvError as e:  # e.g. a budget below what the method must keep
                        row.update({"error": str(e), "score": None})
                    row["kept"] = round(row["cells"] / n_prompt, 4) if row.get("cells") else None
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    done.add(row_key(row))
                    sc = row.get("score")
                    summary.append(f"{m}@{r}={'err' if sc is None else f'{sc:.2f}'}")
                    rep.advance_stage()
                rep.advance(len(mine), f"{label} {ct} L={length} {task} #{i} prefill {prefill_s:.1f}s: "
                            + " ".join(summary))
        finally:
            if sess is not None:
                sess.close()
            for m, _ in models.values():
                m.close()
    if skipped:
        log(f"skipped {skipped} evaluations whose length exceeds the model's trained context")
    return path


def environment() -> dict[str, object]:
    import platform

    from .text import SOURCE

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "text": SOURCE}
