#!/usr/bin/env python3
"""A long document through a small cache: one document with keyed needles at
several depths, ingested once per method through a ``--budget``-cell cache
(compressing whenever the next chunk does not fit, as ``edgekv generate``
does), then one question per needle, each from the state right after the
document (save/restore). Next to it: llama.cpp's context shift with the same
cells, and the full cache where it fits in RAM (``--full``).

Per method: ingest wall time and tok/s, peak RSS (the process's high-water
mark, reset before each ingest), KV MiB, compressions; per needle: its depth
and whether the answer holds the number; the perplexity of a
``--ppl-tokens`` passage of the haystack's book read after the document; and
the decode speed after the document (``--decode-tokens`` greedy tokens). Once the
caches are saved, ``--versus-full`` decodes each method's cache and the full cache in
alternating blocks from their saved states, for a speed-up measured under one load.
A method named ``NAME+rerotate`` renumbers positions after each compression
(docs/methods.md), keeping every distance within the cache.

Resumable: rows go to ``bench/results/long_document/results.jsonl`` as they
are measured, and each method's cache after the document is kept as an edgekv
session file under ``~/.cache/edgekv/long_document/``, so a stopped run asks
the remaining questions without ingesting again.

    .venv/bin/edgekv bench run long_document --model smollm2-135m --tokens 32768 --budget 2048
    .venv/bin/edgekv bench run long_document --model qwen2.5-coder-0.5b --tokens 32768 --budget 2048
    .venv/bin/edgekv bench run long_document --model smollm2-135m --methods knorm,lagkv --versus-full
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from edgekv.bench.results import RESULTS

OUT = RESULTS / "long_document"
METHODS = "streaming_llm,knorm,lagkv,snapkv,chunkkv,h2o,chelsea,context_shift"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=32768, help="document length in tokens")
    ap.add_argument("--budget", type=int, default=2048, help="cells the compressed cache keeps")
    ap.add_argument("--needles", type=int, default=8)
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--full", action="store_true", help="also the full cache (n_ctx = the document)")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--ppl-tokens", type=int, default=256, help="passage read after the document (perplexity)")
    ap.add_argument("--decode-tokens", type=int, default=64, help="greedy tokens decoded after the document (tok/s)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--one-process", action="store_true",
                    help="run every method in this process (default: one subprocess each, so peak RSS is its own)")
    ap.add_argument("--versus-full", action="store_true",
                    help="from the saved caches only: each method's decode against the full cache's, interleaved")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of --versus-full (medians)")
    a = ap.parse_args()
    methods = a.methods.split(",") + (["full"] if a.full else [])
    if len(methods) > 1 and not (a.one_process or a.versus_full):
        import subprocess

        argv = [x for x in sys.argv[1:] if x != "--full"]
        for m in methods:
            at = argv.index("--methods") if "--methods" in argv else None
            rest = argv[:at] + argv[at + 2 :] if at is not None else argv
            rc = subprocess.call([sys.executable, __file__, *rest, "--methods", m, "--one-process"])
            if rc:
                sys.exit(rc)
        return

    from edgekv.bench import tasks
    from edgekv.bench.results import machine
    from edgekv.bench.runner import feed_logits, generate_answer, model_label, stop_rule
    from edgekv.bench.scoring import log_softmax_at, perplexity, score
    from edgekv.bench.speed import decode_pair, decode_rate, proc_status, reset_peak_rss
    from edgekv.llama import Model
    from edgekv.models import edgekv_home, resolve_model
    from edgekv.session import Session

    path = resolve_model(a.model)
    model = Model(path)
    label = model_label(a.model, path)
    a.out.mkdir(parents=True, exist_ok=True)
    rows_path = a.out / "results.jsonl"
    states = edgekv_home() / "long_document"
    states.mkdir(parents=True, exist_ok=True)

    count = lambda s: len(model.tokenize(s, add_special=False))  # noqa: E731
    log(f"{label}: building a {a.tokens}-token document with {a.needles} needles")
    sample = tasks.long_document(a.tokens, a.seed, a.needles, count)
    before, after = tasks.chat_frame(model)
    context = before + sample.intro + sample.context
    ctx_tokens = model.tokenize(context, add_special=True)
    keys, questions, prefixes = sample.meta["keys"], sample.meta["questions"], sample.meta["prefixes"]
    passage = model.tokenize(" " + tasks.passage(a.ppl_tokens, a.seed, count), add_special=False)[: a.ppl_tokens]
    depth = {k: round(sample.context.index(f"for {k} is:") / len(sample.context), 3) for k in keys}
    base = {"model": label, "tokens": a.tokens, "document_tokens": len(ctx_tokens), "budget": a.budget,
            "needles": a.needles, "seed": a.seed}

    def same(r: dict) -> bool:
        return all(r.get(k) == v for k, v in base.items())

    def session_kw(m: str) -> dict:
        if m == "full":
            return {"n_ctx": len(ctx_tokens) + 256}
        if m == "context_shift":
            return {"n_ctx": a.budget}
        return {"budget": a.budget, "n_ctx": a.budget + a.chunk}

    def state_of(m: str) -> Path:
        return states / f"{label}-{m}-{a.tokens}-{a.budget}-{a.needles}-{a.seed}.edgekv"

    def write(row: dict) -> None:
        with open(rows_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    if a.versus_full:
        # Both caches decode the same number of tokens from their state after the document, in
        # alternating blocks of 8, so the ratio is measured under one machine load.
        import numpy as np

        methods = [m for m in methods if m != "full"]  # each is compared with the full cache
        if a.rounds < 1 or not methods:
            sys.exit("--versus-full needs --rounds >= 1 and at least one method besides full")
        missing = [m for m in ["full", *methods] if not state_of(m).exists()]
        if missing:
            sys.exit(f"--versus-full needs the saved caches of {', '.join(missing)}: run those methods first")
        with Session(model, method="full", chunk=a.chunk, n_threads=a.threads, **session_kw("full")) as full:
            full.load_file(state_of("full"))
            full_saved, full_cells = full.save(), full.engine.n_cells
            for m in methods:
                with Session(model, method=m, chunk=a.chunk, n_threads=a.threads, **session_kw(m)) as sess:
                    sess.load_file(state_of(m))
                    saved, cells = sess.save(), sess.engine.n_cells
                    rates = []
                    for _ in range(a.rounds):
                        for s, st in ((sess, saved), (full, full_saved)):
                            s.restore(st)
                            s.feed([ctx_tokens[-1]])  # logits to continue from (a restore drops them)
                        rates.append(decode_pair(sess, full, a.decode_tokens))
                    # the speed-up of each round (both rates from one load), then medians
                    mine, theirs = (float(np.median(x)) for x in zip(*rates, strict=True))
                    speedup = float(np.median([r / f for r, f in rates]))
                    write({**base, "kind": "decode_vs_full", "method": m, "decode_tokens": a.decode_tokens,
                           "rounds": a.rounds, "cells": cells, "full_cells": full_cells,
                           "decode_tok_s": round(mine, 2), "full_decode_tok_s": round(theirs, 2),
                           "speedup": round(speedup, 2), "machine": machine()})
                    log(f"{m}: {mine:.1f} tok/s at {cells} cells against the full cache's {theirs:.1f} "
                        f"({speedup:.2f}x), interleaved, medians of {a.rounds} rounds")
        report(load_rows(rows_path), a.out / "report.md")
        return

    for m in methods:
        mine = [r for r in load_rows(rows_path) if same(r) and r["method"] == m]
        done = {r["needle"] for r in mine if r["kind"] == "needle"}
        ppl_done = any(r["kind"] == "ppl" and r["ppl_tokens"] == len(passage) for r in mine)
        decode_done = any(r["kind"] == "decode" and r["decode_tokens"] == a.decode_tokens for r in mine)
        if len(done) == a.needles and ppl_done and decode_done:
            log(f"{m}: done")
            continue
        state = state_of(m)
        with Session(model, method=m, chunk=a.chunk, n_threads=a.threads, **session_kw(m)) as sess:
            ingest = [r for r in load_rows(rows_path) if same(r) and r["method"] == m and r["kind"] == "ingest"]
            if ingest and state.exists():
                sess.load_file(state)
                log(f"{m}: resumed from {state}")
            else:
                reset_peak_rss()
                t0 = time.perf_counter()
                last = [t0]

                def progress(n: int, total: int, m: str = m, t0: float = t0, last: list = last) -> None:
                    now = time.perf_counter()
                    if now - last[0] > 30 or n == total:
                        last[0] = now
                        log(f"{m}: {n}/{total} tokens, {n / (now - t0):.0f} tok/s, {sess.engine.n_cells} cells")
                sess.feed(ctx_tokens, progress)
                secs = time.perf_counter() - t0
                st = sess.stats
                row = {**base, "kind": "ingest", "method": m, "n_ctx": sess.capacity, "ingest_s": round(secs, 2),
                       "ingest_tok_s": round(len(ctx_tokens) / secs, 1), "peak_rss_mib": round(proc_status("VmHWM"), 1),
                       "cells": st.cells, "kv_mib": round(st.cells * st.kv_bytes_per_cell / 2**20, 2),
                       "kv_allocated_mib": round(sess.capacity * st.kv_bytes_per_cell / 2**20, 2),
                       "compressions": st.compressions, "compress_s": round(st.compress_seconds, 2),
                       "machine": machine()}
                sess.save_file(state)  # before the row: a row always has its saved cache
                write(row)
                log(f"{m}: ingested in {secs:.0f} s ({row['ingest_tok_s']} tok/s), {st.cells} cells, "
                    f"{st.compressions} compressions, peak RSS {row['peak_rss_mib']} MiB")
            saved = sess.save()
            for i, (k, q, p) in enumerate(zip(keys, questions, prefixes, strict=True)):
                if i in done:
                    continue
                sess.restore(saved)
                t0 = time.perf_counter()
                sess.feed_text(f"\n\n{q}{after}{p}", add_special=False)
                out = generate_answer(sess, sample.max_new_tokens, stop_rule("niah_single"))
                answer = sample.answers[i]
                row = {**base, "kind": "needle", "method": m, "needle": i, "key": k, "depth": depth[k],
                       "answer": answer, "output": out.strip()[:80], "score": score("niah_single", out, (answer,)),
                       "answer_s": round(time.perf_counter() - t0, 2)}
                write(row)
                log(f"{m}: needle {i} at depth {depth[k]:.2f}: {row['score']:.0f} ({out.strip()[:40]!r})")
            if not ppl_done:
                sess.restore(saved)
                logits = feed_logits(sess, passage[:-1])
                nll = -sum(log_softmax_at(lg, t) for lg, t in zip(logits, passage[1:], strict=True))
                row = {**base, "kind": "ppl", "method": m, "ppl_tokens": len(passage),
                       "ppl": round(perplexity(nll, len(passage) - 1), 3)}
                write(row)
                log(f"{m}: perplexity {row['ppl']} over a {len(passage)}-token passage after the document")
            if not decode_done:
                # what answering costs per token once the document is in: the cache's cells decide it
                sess.restore(saved)
                cells = sess.engine.n_cells
                sess.feed([ctx_tokens[-1]])  # logits to continue from (a restore drops them)
                rate = decode_rate(sess, a.decode_tokens)
                row = {**base, "kind": "decode", "method": m, "decode_tokens": a.decode_tokens,
                       "cells": cells, "decode_tok_s": round(rate, 2)}
                write(row)
                log(f"{m}: decode {rate:.1f} tok/s after the document ({row['cells']} cells)")
    report(load_rows(rows_path), a.out / "report.md")


def report(rows: list[dict], path: Path) -> None:
    """One table per (model, document, budget): ingest and accuracy per method."""
    lines = ["# A long document through a small cache", "",
             "Command: `.venv/bin/python bench/long_document.py` (see its docstring). Accuracy = needles "
             "whose number the answer holds; depth = where the needle sits in the document (0 = start).", ""]
    groups = sorted({(r["model"], r["tokens"], r["budget"], r["needles"], r["seed"]) for r in rows})
    for g in groups:
        rs = [r for r in rows if (r["model"], r["tokens"], r["budget"], r["needles"], r["seed"]) == g]
        lines += [f"## {g[0]}, {g[1]}-token document, {g[2]}-cell budget, {g[3]} needles", "",
                  "| method | ingest s | tok/s | peak RSS MiB | KV MiB (allocated) | compressions | accuracy % "
                  "| found at depths | passage ppl | decode tok/s | against the full cache, interleaved |",
                  "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
        for m in dict.fromkeys(r["method"] for r in rs):
            ing = next((r for r in reversed(rs) if r["method"] == m and r["kind"] == "ingest"), None)  # the latest
            nd = sorted((r for r in rs if r["method"] == m and r["kind"] == "needle"), key=lambda r: r["depth"])
            if ing is None or not nd:
                continue
            acc = 100 * sum(r["score"] for r in nd) / len(nd)
            found = ", ".join(f"{r['depth']:.2f}" for r in nd if r["score"] > 0) or "none"
            ppl = next((f"{r['ppl']:.2f}" for r in reversed(rs) if r["method"] == m and r["kind"] == "ppl"), "")
            dec = next((f"{r['decode_tok_s']:.1f}" for r in reversed(rs) if r["method"] == m and r["kind"] == "decode"), "")
            vs = next((f"{r['decode_tok_s']:.1f} against {r['full_decode_tok_s']:.1f} tok/s ({r['speedup']:.2f}x)"
                       for r in reversed(rs) if r["method"] == m and r["kind"] == "decode_vs_full"), "")
            lines.append(f"| {m} | {ing['ingest_s']:.0f} | {ing['ingest_tok_s']:.0f} | {ing['peak_rss_mib']:.0f} "
                         f"| {ing['kv_mib']:.1f} ({ing['kv_allocated_mib']:.1f}) | {ing['compressions']} "
                         f"| {acc:.0f} ({len(nd)} needles) | {found} | {ppl} | {dec} | {vs} |")
        lines.append("")
    path.write_text("\n".join(lines))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
