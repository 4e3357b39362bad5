"""``edgekv calibrate``: find a model's semantic retrieval heads for CompressKV.

CompressKV (arXiv:2508.02401) credits each (layer, query head) with the
attention mass it puts on a needle's whole answer span at every decoding step
whose emitted token belongs to the answer, summed over the steps of a run and
averaged over the runs the model answered (unigram recall of the answer
above 0.5). The paper calibrates on 600 long needle runs; edgekv generates
its own small set, runs it through llama.cpp, and needs no download:

- three needles of its own (a sentence, a question, the answer in the
  sentence), in Jane Austen's prose (the bench's haystack text);
- ``lengths`` x ``depths`` contexts per needle (default 4 x 4: 48 runs, up to
  3k tokens), each asked in the model's chat template, answered greedily.

The attention comes from llama.cpp itself: flash attention is off, so the
softmax of every layer (``kq_soft_max-<il>``) exists as a graph node, and the
tensor capture copies it during the decoding steps only. Its columns are
cells; after a fresh prefill of one sequence they are the positions, which
each run checks. Only the layers a snapshot holds are calibrated (all, or
Gemma 3's global layers).

The profile is saved under the GGUF file's SHA-256 (``edgekv/profiles.py``).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .bench import tasks, text
from .errors import EdgekvError
from .kvcache.state import StateEngine
from .llama import Context, Model
from .profiles import HeadProfile, file_sha256

# (needle sentence, question, answer: the words of the sentence the model must copy)
NEEDLES = [
    ("The secret ingredient in Grandmother Rosalind's apple pie is a spoonful of smoked paprika "
     "and a pinch of cardamom.",
     "What is the secret ingredient in Grandmother Rosalind's apple pie?",
     "a spoonful of smoked paprika and a pinch of cardamom"),
    ("The best thing to do in Lisbon is to ride the old yellow tram up the hill and watch the "
     "sunset from the castle walls.",
     "What is the best thing to do in Lisbon?",
     "ride the old yellow tram up the hill and watch the sunset from the castle walls"),
    ("Captain Moreau abandoned the expedition because the river had frozen solid and his sled "
     "dogs refused to cross it.",
     "Why did Captain Moreau abandon the expedition?",
     "because the river had frozen solid and his sled dogs refused to cross it"),
]

ProgressFn = Callable[[int, int, str], None]


@dataclass
class CalibrationGrid:
    lengths: tuple[int, ...] = (512, 1024, 2048, 3072)
    depths: tuple[float, ...] = (0.0, 0.33, 0.67, 1.0)
    needles: int = 3
    max_new: int = 32
    threads: int | None = None

    def runs(self) -> int:
        return min(self.needles, len(NEEDLES)) * len(self.lengths) * len(self.depths)


def _words(s: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", s.lower())


def recall(answer: str, response: str) -> float:
    """Unigram recall of the answer's words in the response (ROUGE-1 recall, no stemming)."""
    want = _words(answer)
    got = set(_words(response))
    return sum(w in got for w in want) / max(1, len(want))


def _haystack(model: Model, n_tokens: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    sents = text.sentences()
    i = rng.randrange(len(sents))
    out: list[str] = []
    total = 0
    while total < n_tokens:
        s = sents[i % len(sents)]
        i += 1
        out.append(s)
        total += len(model.tokenize(s + " ", add_special=False))
    return out


def _prompt(model: Model, frame: tuple[str, str], n_tokens: int, depth: float, needle: tuple[str, str, str],
            seed: int) -> tuple[list[int], tuple[int, int]]:
    """Tokens of one run and the answer span [a0, a1) inside them."""
    sentence, question, answer = needle
    ask = f"\n\nBased on the text above, answer the question: {question}"
    fixed = len(model.tokenize(frame[0] + ask + frame[1], add_special=True)) + len(
        model.tokenize(sentence, add_special=False))
    hay = _haystack(model, max(64, n_tokens - fixed), seed)
    hay.insert(round(depth * len(hay)), sentence)
    toks = model.tokenize(frame[0] + " ".join(hay) + ask + frame[1], add_special=True)
    return toks, _span(model, toks, answer)


def _span(model: Model, toks: list[int], answer: str) -> tuple[int, int]:
    """The window of len(answer tokens) holding the most of the answer's distinct token ids,
    the earliest on ties; it must hold more than 90 % of them (the paper's threshold: the
    tokens in context can differ from the answer's own; the paper takes the first window
    above it, which can start a token early)."""
    ans = model.tokenize(" " + answer, add_special=False)
    want = set(ans)
    n = len(ans)
    best, at = -1, -1
    for i in range(len(toks) - n + 1):
        hit = len(want & set(toks[i : i + n]))
        if hit > best:
            best, at = hit, i
    if best <= 0.9 * len(want):
        raise EdgekvError("the needle's answer is not in the tokenised prompt")
    return at, at + n


def calibrate(model_path: str, grid: CalibrationGrid, progress: ProgressFn | None = None) -> HeadProfile:
    """Run the grid and return the profile (not yet saved)."""
    model = Model(model_path)
    info = model.info
    if info.attn_logit_softcap:
        raise EdgekvError(f"{info.arch} soft-caps its attention logits; CompressKV's scores would not be its attention")
    layers = info.global_layers if info.is_swa_model else tuple(range(info.n_layer))
    frame = tasks.chat_frame(model)
    totals = np.zeros((len(layers), info.n_head))
    ok = done = 0
    t0 = time.perf_counter()
    try:
        for ni, needle in enumerate(NEEDLES[: grid.needles]):
            for length in grid.lengths:
                for depth in grid.depths:
                    run, answered = _run(model, layers, frame, length, depth, needle, seed=ni * 1000 + length,
                                         max_new=grid.max_new, threads=grid.threads)
                    done += 1
                    if answered:
                        totals += run
                        ok += 1
                    if progress:
                        progress(done, grid.runs(), f"needle {ni + 1} L={length} depth {depth:.2f}: "
                                 f"{'answered' if answered else 'missed'} ({ok}/{done} so far, "
                                 f"{time.perf_counter() - t0:.0f} s)")
    finally:
        model.close()
    if ok == 0:
        raise EdgekvError(f"the model answered none of the {done} calibration runs; its retrieval heads cannot be "
                          "found this way (try shorter --lengths)")
    scores = totals / ok
    return HeadProfile(model=info.path.name, sha256=file_sha256(info.path), layers=list(layers),
                       scores=[[round(float(x), 6) for x in row] for row in scores], runs=done, successful=ok,
                       grid={"lengths": list(grid.lengths), "depths": list(grid.depths), "needles": grid.needles,
                             "max_new": grid.max_new})


def _run(model: Model, layers: tuple[int, ...], frame: tuple[str, str], length: int, depth: float,
         needle: tuple[str, str, str], *, seed: int, max_new: int, threads: int | None) -> tuple[np.ndarray, bool]:
    """One needle run: credit per (layer row, query head), and whether the model answered."""
    toks, (a0, a1) = _prompt(model, frame, length, depth, needle, seed)
    span = toks[a0:a1]
    ctx = Context(model, n_ctx=len(toks) + max_new + 8, n_batch=512, flash_attn="off", n_threads=threads)
    try:
        if ctx.capture is None:
            raise EdgekvError("calibration needs the tensor capture (edgekv/_edgekv_capture*.so)")
        eng = StateEngine(ctx)
        body = toks[:-1]
        for i in range(0, len(body), 512):
            eng.decode(body[i : i + 512], i)
        if not np.array_equal(eng.cell_positions(), np.arange(len(body))):
            raise EdgekvError("llama.cpp did not lay the prompt out in cell order; cannot map attention to tokens")
        ctx.capture.want("kq_soft_max", layers)
        run = np.zeros((len(layers), model.info.n_head))
        out: list[int] = []
        x, p = toks[-1], len(toks) - 1
        for _ in range(max_new):
            eng.decode([x], p)
            y = int(np.argmax(ctx.logits(-1)))
            mult = span.count(y)
            if mult:
                for row, il in enumerate(layers):
                    a = ctx.capture.get("kq_soft_max", il)  # [1, n_head, 1, n_kv]
                    run[row] += mult * a[0, :, 0, a0:a1].sum(axis=1)
            if model.is_eog(y) or b"\n" in model.piece(y):
                break
            out.append(y)
            x, p = y, p + 1
        response = b"".join(model.piece(t) for t in out).decode("utf-8", "replace")
        return run, recall(needle[2], response) > 0.5
    finally:
        ctx.close()
