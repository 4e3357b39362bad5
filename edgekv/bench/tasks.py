"""RULER-style synthetic long-context tasks, generated deterministically from a seed.

Every task builds a context of about ``n_tokens`` tokens (context, question and
answer together; the answer budget is ``max_new_tokens``), a question and the
reference answers. The same (task, n_tokens, seed, index) and the same token
counter always give the same sample. Haystacks are real English text
(:mod:`edgekv.bench.text`, Jane Austen's novels) except for ``passkey``,
which keeps the classic repetitive filler (Mohtashami & Jaggi 2023).

Tasks (after RULER, Hsieh et al. 2024, arXiv 2404.06654):

- ``passkey``: one 5-digit pass key in repeated filler sentences.
- ``niah_single``: one "special magic number" for a word key in real text.
- ``niah_multikey``: four needles with different keys; one is asked for.
- ``niah_multivalue``: four numbers for the same key; all are asked for.
- ``vt``: variable tracking; a chain ``VAR A = 12345 ... VAR B = VAR A`` hidden in
  the text; every variable holding the value is asked for.
- ``cwe``: common-words extraction; a numbered word list where ``num_cw`` words
  occur ``freq_cw`` times and the rest at most ``freq_ucw`` times.
- ``ppl``: not a question: a contiguous passage (context) and the next
  ``eval_tokens`` tokens, whose negative log-likelihood is measured.

A ``Prompt`` turns a sample into the two strings the protocol needs: the part
that is prefilled and compressed (``context``) and the part that arrives after
compression (``query``).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import EdgekvError

Counter = Callable[[str], int]

QA_TASKS = ("passkey", "niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe")
# multiturn: one context, then a question per turn with the cache compressed before each (SCBench's
# multi-turn setting); reported beside the one-question tasks, not in their average
TASKS = QA_TASKS + ("multiturn", "ppl")
MULTITURN_TURNS = 4

# Words for needle keys: none is a word Austen would write hyphenated with another.
ADJECTIVES = (
    "amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly",
    "keen", "lively", "misty", "noble", "odd", "pale", "quiet", "rapid", "silent", "tidy",
    "urban", "vivid", "wary", "young", "zesty", "bold", "crisp", "damp", "early", "fierce",
    "golden", "hasty", "idle", "jagged", "kind", "lucky", "mellow", "narrow", "orange", "proud",
)
NOUNS = (
    "anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island",
    "jacket", "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river",
    "saddle", "tunnel", "umbrella", "valley", "walnut", "yacht", "zipper", "basket", "canyon",
    "desert", "feather", "glacier", "hammer", "ivory", "jungle", "kitten", "ladder", "mirror",
    "nectar", "oyster", "pillow", "rocket",
)

# Needles go in the first 90 % of the context: the last sentences sit in the
# recent window that every method keeps, where a needle would test nothing.
MAX_DEPTH = 0.9
# Tokens left for joins and a chat template's framing (counts of parts do not add up exactly).
SLACK = 16

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@dataclass(frozen=True)
class Sample:
    """One task instance. ``answers`` are the strings the output must contain
    (all of them for full credit); for ``ppl`` it is empty and ``passage``
    holds the text to score."""

    task: str
    index: int
    n_tokens: int
    intro: str
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    max_new_tokens: int
    meta: dict = field(default_factory=dict, hash=False, compare=True)

    @property
    def body(self) -> str:
        return self.intro + self.context


def approx_tokens(text: str) -> int:
    """A model-free token estimate (about 4 characters per token of English)."""
    return max(1, (len(text) + 3) // 4)


def _rng(task: str, n_tokens: int, seed: int, index: int) -> random.Random:
    # A string seed is hashed with SHA-512 by random.Random: stable across runs and platforms.
    return random.Random(f"edgekv-bench/{task}/{n_tokens}/{seed}/{index}")


def _number(rng: random.Random, digits: int, taken: set[str]) -> str:
    while True:
        v = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        if v not in taken:
            taken.add(v)
            return v


def _keys(rng: random.Random, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        k = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if k not in out:
            out.append(k)
    return out


def _haystack(rng: random.Random, budget: int, count: Counter) -> list[str]:
    """Consecutive sentences of a book, from a random start, totalling about ``budget`` tokens."""
    from . import text

    sents = text.sentences()
    start = rng.randrange(len(sents))
    out: list[str] = []
    total = 0
    i = start
    while total < budget:
        s = sents[i % len(sents)]
        i += 1
        if re.search(r"\d", s):  # keep digits out: numbers are the answers
            continue
        out.append(s)
        total += count(s + " ")
    return out


def passage(n_tokens: int, seed: int, count: Counter) -> str:
    """About ``n_tokens`` of the haystack's book from a seeded start: a continuation to
    measure perplexity on after a long document (the long-document benchmark)."""
    return " ".join(_haystack(_rng("passage", n_tokens, seed, 0), n_tokens, count))


def _filler_haystack(budget: int, count: Counter) -> list[str]:
    per = count(FILLER + " ")
    return [FILLER] * max(2, budget // max(per, 1) + 1)


def _insert(rng: random.Random, hay: list[str], needles: list[str], depths: list[float] | None = None) -> list[float]:
    """Insert needles between sentences at random (or given) depths; returns the depths used."""
    if depths is None:
        depths = sorted(rng.uniform(0.0, MAX_DEPTH) for _ in needles)
    # Insert from the deepest so earlier indices stay valid.
    for d, nd in sorted(zip(depths, needles, strict=True), key=lambda x: -x[0]):
        hay.insert(round(d * len(hay)), nd)
    return depths


def _fit(parts: list[str], fixed: str, target: int, count: Counter, protect: set[int]) -> list[str]:
    """Drop trailing unprotected sentences until ``fixed`` + context fits in ``target`` tokens."""
    while True:
        n = count(" ".join(parts)) + count(fixed)
        if n <= target:
            return parts
        over = n - target
        # Remove from the end (never a needle): roughly as many sentences as the overshoot needs.
        removed = 0
        for j in range(len(parts) - 1, -1, -1):
            if j in protect:
                continue
            removed += count(parts[j] + " ")
            del parts[j]
            protect = {p - 1 if p > j else p for p in protect}
            if removed >= over:
                break
        else:
            raise EdgekvError(f"cannot fit the task into {target} tokens")


def _fit_needles(rng: random.Random, budget_ctx: int, needles: list[str], count: Counter,
                 fixed: str, hay: list[str] | None = None) -> tuple[list[str], list[float]]:
    hay = hay if hay is not None else _haystack(rng, budget_ctx, count)
    _insert(rng, hay, needles)
    idx = {i for i, s in enumerate(hay) if s in needles}
    parts = _fit(hay, fixed, budget_ctx + count(fixed), count, idx)
    # Depths as positions in the final context (fraction of sentences before each needle).
    pos = [i / max(len(parts) - 1, 1) for i, s in enumerate(parts) if s in needles]
    return parts, pos


NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
              "I will quiz you about the numbers afterwards.\n")


def _niah(task: str, n_tokens: int, seed: int, index: int, count: Counter) -> Sample:
    rng = _rng(task, n_tokens, seed, index)
    taken: set[str] = set()
    if task == "passkey":
        key = _number(rng, 5, taken)
        intro = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.\n")
        question = "What is the pass key?"
        prefix = "The pass key is"
        needles = [f"The pass key is {key}. Remember it."]
        answers: tuple[str, ...] = (key,)
        max_new = 8
        fixed = intro + question + prefix
        budget = n_tokens - count(fixed) - max_new - SLACK
        hay = _filler_haystack(budget, count)
        parts, depths = _fit_needles(rng, budget, needles, count, intro + question + prefix, hay)
        return Sample(task, index, n_tokens, intro, " ".join(parts), question, prefix, answers, max_new,
                      {"depths": depths})
    n_keys = 4 if task == "niah_multikey" else 1
    n_vals = 4 if task == "niah_multivalue" else 1
    keys = _keys(rng, n_keys)
    target = keys[0]
    vals = {k: [_number(rng, 7, taken) for _ in range(n_vals if k == target else 1)] for k in keys}
    needles = [f"One of the special magic numbers for {k} is: {v}." for k in keys for v in vals[k]]
    rng.shuffle(needles)
    if n_vals > 1:
        question = f"What are all the special magic numbers for {target} mentioned in the provided text?"
        prefix = f"The special magic numbers for {target} mentioned in the provided text are"
        max_new = 48
    else:
        question = f"What is the special magic number for {target} mentioned in the provided text?"
        prefix = f"The special magic number for {target} mentioned in the provided text is"
        max_new = 12
    fixed = NIAH_INTRO + question + prefix
    budget = n_tokens - count(fixed) - max_new - SLACK
    parts, depths = _fit_needles(rng, budget, needles, count, fixed)
    return Sample(task, index, n_tokens, NIAH_INTRO, " ".join(parts), question, prefix, tuple(vals[target]),
                  max_new, {"keys": keys, "depths": depths})


def _multiturn(n_tokens: int, seed: int, index: int, count: Counter, turns: int = MULTITURN_TURNS) -> Sample:
    """``turns`` keyed needles in one haystack, asked one per turn in random order."""
    rng = _rng("multiturn", n_tokens, seed, index)
    taken: set[str] = set()
    keys = _keys(rng, turns)
    vals = {k: _number(rng, 7, taken) for k in keys}
    needles = [f"One of the special magic numbers for {k} is: {vals[k]}." for k in keys]
    rng.shuffle(needles)
    order = keys[:]
    rng.shuffle(order)
    questions = [f"What is the special magic number for {k} mentioned in the provided text?" for k in order]
    prefixes = [f"The special magic number for {k} mentioned in the provided text is" for k in order]
    max_new = 12
    # every later turn's question, prefix and answer arrive after the context too (a chat template's turn markers
    # are not counted: the sweep's context holds length + 192 cells, room for them)
    fixed = NIAH_INTRO + "".join(q + p for q, p in zip(questions, prefixes, strict=True))
    budget = n_tokens - count(fixed) - turns * max_new - SLACK
    parts, depths = _fit_needles(rng, budget, needles, count, fixed)
    return Sample("multiturn", index, n_tokens, NIAH_INTRO, " ".join(parts), questions[0], prefixes[0],
                  tuple(vals[k] for k in order), max_new,
                  {"keys": order, "questions": questions, "prefixes": prefixes, "depths": depths})


def long_document(n_tokens: int, seed: int, needles: int, count: Counter) -> Sample:
    """One long document with ``needles`` keyed needles at random depths, each asked on
    its own (``meta``: questions, prefixes, depths): the long-document benchmark's task,
    the multi-turn task's haystack with more needles."""
    return _multiturn(n_tokens, seed, 0, count, turns=needles)


def _var_name(rng: random.Random, taken: set[str]) -> str:
    while True:
        v = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if v not in taken:
            taken.add(v)
            return v


def _vt(n_tokens: int, seed: int, index: int, count: Counter, hops: int = 4, chains: int = 1) -> Sample:
    rng = _rng("vt", n_tokens, seed, index)
    names: set[str] = set()
    nums: set[str] = set()
    all_chains = []
    for _ in range(chains):
        value = _number(rng, 5, nums)
        vs = [_var_name(rng, names) for _ in range(hops + 1)]
        stmts = [f"VAR {vs[0]} = {value}."] + [f"VAR {vs[i + 1]} = VAR {vs[i]}." for i in range(hops)]
        all_chains.append((value, vs, stmts))
    value, target_vars, _ = all_chains[0]
    intro = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n")
    question = f"Find all variables that are assigned the value {value} in the text above."
    prefix = (f"According to the chain(s) of variable assignment in the text above, {hops + 1} variables are "
              f"assigned the value {value}, they are:")
    max_new = 6 * (hops + 1) + 4
    fixed = intro + question + prefix
    budget = n_tokens - count(fixed) - max_new - SLACK
    hay = _haystack(rng, budget, count)
    # The statements of a chain stay in order: sorted depths per chain.
    needles = [s for _, _, st in all_chains for s in st]
    depths: list[float] = []
    for _, _, st in all_chains:
        depths += sorted(rng.uniform(0.0, MAX_DEPTH) for _ in st)
    _insert(rng, hay, needles, depths)
    idx = {i for i, s in enumerate(hay) if s in needles}
    parts = _fit(hay, fixed, n_tokens - max_new - SLACK, count, idx)
    return Sample("vt", index, n_tokens, intro, " ".join(parts), question, prefix, tuple(target_vars), max_new,
                  {"value": value, "hops": hops, "chains": chains})


def _cwe(n_tokens: int, seed: int, index: int, count: Counter, num_cw: int = 10) -> Sample:
    from . import text

    rng = _rng("cwe", n_tokens, seed, index)
    vocab = text.vocabulary()
    intro = "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n"
    question = f"What are the {num_cw} most common words in the above list?"
    prefix = f"The top {num_cw} words that appear most often in the list are:"
    max_new = 4 * num_cw + 8
    fixed = intro + question + prefix
    budget = n_tokens - count(fixed) - max_new - SLACK
    # Size the list: an entry "123. word" costs about per_entry tokens.
    probe = " ".join(f"{i + 100}. {w}" for i, w in enumerate(rng.sample(vocab, 50)))
    per_entry = count(probe) / 50
    capacity = max(num_cw * 4, int(budget / per_entry))
    # RULER's setting at 4k and above (30 vs 3); shorter contexts scale the counts down.
    freq_cw = max(3, min(30, capacity // (2 * num_cw)))
    freq_ucw = max(1, min(3, freq_cw // 3))
    n_ucw = max(1, (capacity - num_cw * freq_cw) // freq_ucw)
    words = rng.sample(vocab, num_cw + n_ucw)
    common, uncommon = words[:num_cw], words[num_cw:]
    while True:
        lst = common * freq_cw + uncommon * freq_ucw
        rng.shuffle(lst)
        body = " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst))
        if count(body) + count(fixed) <= n_tokens - max_new - SLACK or len(uncommon) <= 1:
            break
        uncommon = uncommon[: int(len(uncommon) * 0.95)]
    return Sample("cwe", index, n_tokens, intro, body, question, prefix, tuple(common), max_new,
                  {"freq_cw": freq_cw, "freq_ucw": freq_ucw, "n_ucw": len(uncommon)})


def _ppl(n_tokens: int, seed: int, index: int, count: Counter, eval_tokens: int = 128) -> Sample:
    """A contiguous passage of one book: ~n_tokens of context and ~eval_tokens more (whole paragraphs)."""
    from . import text

    rng = _rng("ppl", n_tokens, seed, index)
    books = text.books()
    name = rng.choice(sorted(books))
    paras = books[name]
    start = rng.randrange(len(paras))
    out: list[str] = []
    total = 0
    i = start
    while total < n_tokens + eval_tokens + 32:
        p = paras[i % len(paras)]
        i += 1
        out.append(p)
        total += count(p + "\n\n")
    return Sample("ppl", index, n_tokens, "", "\n\n".join(out), "", "", (), eval_tokens,
                  {"book": name, "paragraph": start, "eval_tokens": eval_tokens})


def make_sample(task: str, n_tokens: int, seed: int, index: int, count: Counter | None = None) -> Sample:
    """The sample ``index`` of ``task`` at about ``n_tokens`` tokens (deterministic)."""
    count = count or approx_tokens
    if n_tokens < 128:
        raise EdgekvError(f"context length {n_tokens} is too short for a task (minimum 128)")
    if task in ("passkey", "niah_single", "niah_multikey", "niah_multivalue"):
        return _niah(task, n_tokens, seed, index, count)
    if task == "multiturn":
        return _multiturn(n_tokens, seed, index, count)
    if task == "vt":
        return _vt(n_tokens, seed, index, count)
    if task == "cwe":
        return _cwe(n_tokens, seed, index, count)
    if task == "ppl":
        return _ppl(n_tokens, seed, index, count)
    raise EdgekvError(f"unknown task {task!r}; available: {', '.join(TASKS)}")


# ---------------------------------------------------------------------------
# prompts


@dataclass(frozen=True)
class Prompt:
    """What is prefilled (and compressed) and what arrives after compression."""

    context: str
    query: str


def chat_frame(model) -> tuple[str, str]:
    """(before, after) the user message in the model's chat template."""
    mark = "\x1fEDGEKV\x1f"
    rendered = model.apply_chat_template([{"role": "user", "content": mark}], add_assistant=True)
    if mark not in rendered:
        raise EdgekvError("the chat template dropped the message")
    before, after = rendered.split(mark, 1)
    return before, after


def turn_separator(model) -> str:
    """The chat template's text between an assistant reply and the next user message."""
    a, b = "\x1fEDGEKV-A\x1f", "\x1fEDGEKV-B\x1f"
    rendered = model.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": a},
                                          {"role": "user", "content": b}], add_assistant=True)
    if a not in rendered or b not in rendered:
        raise EdgekvError("the chat template dropped a message")
    return rendered.split(a, 1)[1].split(b, 1)[0]


def later_turns(s: Sample, frame: tuple[str, str] | None, separator: str | None) -> list[Prompt]:
    """The turns after the first (multiturn), as (question, what follows it): the end of the
    last reply and the next user turn with its question, then the end of that turn and the
    answer prefix. Query-agnostic, the cache is compressed before a turn's question; query-aware,
    between its question and the rest. The first turn is ``build_prompt``'s."""
    _, after = frame or ("", "\n")
    sep = separator if separator is not None else "\n"
    return [Prompt(context=sep + q, query=after + p)
            for q, p in zip(s.meta["questions"][1:], s.meta["prefixes"][1:], strict=True)]


def build_prompt(s: Sample, *, query_aware: bool = False, frame: tuple[str, str] | None = None) -> Prompt:
    """Query-agnostic by default: the question arrives after the compressed context.

    ``query_aware``: the question ends the compressed part (kvpress's
    "compressed questions", the SnapKV paper's setting), so attention methods
    see it in their observation window; only the end of the user turn and the
    answer prefix come after the compression. ``frame`` wraps the user turn in
    a chat template: (text before the message, text after it).
    """
    before, after = frame or ("", "\n")
    ask = f"\n\n{s.question}"
    if query_aware:
        return Prompt(context=before + s.intro + s.context + ask, query=after + s.answer_prefix)
    return Prompt(context=before + s.intro + s.context, query=ask + after + s.answer_prefix)
