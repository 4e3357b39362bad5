"""Speed and memory: prefill tok/s, decode tok/s with a full against a compressed
cache, time per compression event, compression overhead against prefill time,
KV bytes and peak RSS.

For each (model, cache type, context length):

- ``oneshot``: prefill ``length`` tokens of real text once (full cache), decode
  ``decode_tokens`` greedily on the full cache; then, for each method, restore
  the prefill, compress once to ``(1 - ratio)`` of the cells (one timed event),
  and decode the same number of tokens on the compressed cache, in blocks that
  alternate with a fresh context holding as many cells of the same text
  (``fresh_decode_tok_s``): a compressed cache should decode as fast as one.
- ``stream`` (``--stream``): a bounded session, ``budget = (1 - ratio) x
  length`` cells, ingests the same text in 256-token chunks, compressing
  whenever the cache fills (llama.cpp's context shift runs with n_ctx = that
  budget); reports the events, their mean time and their share of the ingest.

Peak RSS is the process high-water mark (VmHWM), reset before each
measurement through /proc/self/clear_refs where the kernel allows it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import EdgekvError
from ..ggml_types import kv_kwargs, kv_types

SPEED_FILE = "speed.jsonl"


@dataclass
class SpeedGrid:
    models: list[str | None] = field(default_factory=lambda: [None])
    methods: list[str] = field(default_factory=lambda: ["full", "streaming_llm", "knorm"])
    ratio: float = 0.75
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    cache_types: list[str] = field(default_factory=lambda: ["f16"])
    flash_attn: list[str] = field(default_factory=lambda: ["auto"])  # each value is measured
    decode_tokens: int = 64
    stream: bool = True
    threads: int | None = None
    # layers offloaded to a GPU, each value measured in turn per length (0: the CPU alone; -1: all)
    n_gpu_layers: list[int] = field(default_factory=lambda: [0])
    out: Path = Path("bench/results")


def proc_status(field_name: str, pid: int | str = "self") -> float:
    """A VmXXX line (VmRSS, VmHWM, ...) of a process's /proc status in MiB (nan where there is
    no procfs)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def reset_peak_rss() -> None:
    """Reset the process's peak RSS (VmHWM), so a later reading is this measurement's."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def long_text_tokens(model, n: int) -> list[int]:
    """n tokens of continuous real text (the novels, from the beginning of Emma)."""
    from . import text

    paras = [p for b in text.BOOKS for p in text.books()[b]]
    chars = n * 8  # English runs at about 4-5 characters per token
    toks: list[int] = []
    while len(toks) < n and chars < 20 * n:
        toks = model.tokenize("\n\n".join(_prefix(paras, chars)), add_special=True)
        chars *= 2
    if len(toks) < n:
        raise EdgekvError(f"not enough text for {n} tokens")
    return toks[:n]


def _prefix(paras: list[str], chars: int) -> list[str]:
    out, total = [], 0
    for p in paras:
        if total >= chars:
            break
        out.append(p)
        total += len(p) + 2
    return out


def decode_rate(sess, n: int) -> float:
    """Greedy decode of n tokens (argmax fed back; no stop at end-of-text); tok/s."""
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(np.argmax(sess.logits()))
        sess.feed([tok])
    return n / (time.perf_counter() - t0)


def decode_pair(a, b, n: int, block: int = 8) -> tuple[float, float]:
    """Greedy decode of n tokens on each of two sessions in alternating blocks; tok/s of each.
    Alternating puts both under the same machine load, so their ratio is the one to quote."""
    if n <= 0:
        return 0.0, 0.0
    ta = tb = 0.0
    for i in range(0, n, block):
        k = min(block, n - i)
        ta += k / decode_rate(a, k)
        tb += k / decode_rate(b, k)
    return n / ta, n / tb


def _replace(path: Path, rows: list[dict], key: Callable[[dict], tuple]) -> None:
    from .runner import load_rows

    keep = {key(r) for r in rows}
    old = [r for r in load_rows(path) if key(r) not in keep]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in old + rows:
            f.write(json.dumps(r) + "\n")
    tmp.replace(path)


def _key(r: dict) -> tuple:
    # Rows written before flash attention was recorded all ran with it on.
    return (r["model"], r["cache_type"], r.get("flash_attn", "on"), r["length"], r["mode"], r["method"], r["ratio"],
            r.get("n_gpu_layers", 0))


def run_speed(grid: SpeedGrid, log: Callable[[str], None] | None = None) -> Path:
    from ..llama import Model, check_flash_attn
    from ..methods import get_method
    from ..models import resolve_model
    from ..session import Session
    from .runner import model_label

    log = log or (lambda s: print(s, flush=True))
    for m in grid.methods:
        get_method(m)  # unknown names and bad parameters are one-line errors, before any model loads
    if not 0.0 < grid.ratio < 1.0:
        raise EdgekvError("--ratio must be in (0, 1)")
    for fa in grid.flash_attn:
        check_flash_attn(fa, "f16")  # a known setting; quantised caches skip "off" below
    grid.out.mkdir(parents=True, exist_ok=True)
    path = grid.out / SPEED_FILE
    for model_arg in grid.models:
        mpath = resolve_model(model_arg)
        label = model_label(model_arg, mpath)
        # one model per offload setting, all loaded at once: each length is measured on every
        # device in turn, so the devices' numbers come from the same stretch of the run
        models = {ngl: Model(mpath, n_gpu_layers=ngl) for ngl in grid.n_gpu_layers}
        try:
            for ct in grid.cache_types:
                for length in grid.lengths:
                    for model in models.values():
                        if model.arch.n_ctx_train and length > model.arch.n_ctx_train:
                            log(f"skip {label} {length}: above the trained context {model.arch.n_ctx_train}")
                            continue
                        for fa in _flash_settings(grid, ct, model, label, log):
                            rows = _one(model, label, ct, fa, length, grid, Session, log)
                            _replace(path, rows, _key)
        finally:
            for model in models.values():
                model.close()
    return path


def _flash_settings(grid: SpeedGrid, ct: str, model, label: str, log: Callable[[str], None]) -> list[str]:
    """The grid's flash-attention settings as this model resolves them, each once."""
    from ..llama import UNQUANTISED_V, resolve_flash_attn

    fas: list[str] = []
    v_type = kv_types(ct)[1]  # the V half decides whether flash attention is needed
    for fa in grid.flash_attn:
        r = resolve_flash_attn(fa, v_type, model.n_gpu_layers)
        if r == "off" and v_type not in UNQUANTISED_V:
            log(f"skip {label} {ct} with flash attention off: a quantised V cache needs it")
        elif r not in fas:
            fas.append(r)
    return fas


def _fresh(model, toks: list[int], grid: SpeedGrid, ct: str, fa: str, Session, observe: int,
           moments: bool) -> tuple:
    """A new context prefilled with ``toks`` and saved: the baseline a compressed cache of
    as many cells is compared with (recording the same queries while it decodes)."""
    sess = Session(model, method="full", n_ctx=len(toks) + grid.decode_tokens + 16, chunk=512, **kv_kwargs(ct),
                   flash_attn=fa, n_threads=grid.threads, observe=observe, moments=moments)
    sess.feed(toks)
    return sess, sess.save(), len(toks)


def _one(model, label, ct, fa, length, grid: SpeedGrid, Session, log) -> list[dict]:
    from ..llama import buffer_sizes
    from ..methods import get_method
    from . import protocol

    toks = long_text_tokens(model, length)
    base = {"model": label, "cache_type": ct, "flash_attn": fa, "length": length, "threads": grid.threads,
            "n_gpu_layers": model.n_gpu_layers}
    if any(get_method(m).needs & {"queries"} for m in grid.methods):
        base["observe"] = True  # the one-shot prefill recorded the observation window (not H2O's tally)
    rows: list[dict] = []
    n_ctx = length + grid.decode_tokens + 16
    # the prefill records the queries the grid's attention methods read (its cost is in prefill_s)
    # (H2O's tally would slow every decode of this shared session: tallying methods run in stream mode only)
    observe = max((get_method(m).queries_needed for m in grid.methods), default=0)
    moments = any(get_method(m).query_statistics for m in grid.methods)  # Expected Attention's statistics
    with Session(model, method="full", n_ctx=n_ctx, chunk=512, **kv_kwargs(ct),
                 flash_attn=fa, n_threads=grid.threads, observe=observe, moments=moments) as sess:
        reset_peak_rss()
        pre = protocol.prefill(sess, toks)
        prefill_s, n_prompt = pre.seconds, pre.n_cells
        per_cell = sess.stats.kv_bytes_per_cell
        # where the cache really is: a build without the GPU backend keeps it in host memory
        base["kv_on"] = sorted(buffer_sizes(sess.ctx.creation_log, "KV")) or ["CPU"]
        dec = decode_rate(sess, grid.decode_tokens)
        rows.append({**base, "mode": "oneshot", "method": "full", "ratio": 0.0, "prefill_s": round(prefill_s, 3),
                     "prefill_tok_s": round(length / prefill_s, 1), "decode_tok_s": round(dec, 2),
                     "cells": n_prompt, "kv_bytes": n_prompt * per_cell, "kv_bytes_allocated": n_ctx * per_cell,
                     "peak_rss_mib": round(proc_status("VmHWM"), 1)})
        where = f" ngl={model.n_gpu_layers} (KV on {'+'.join(base['kv_on'])})" if model.n_gpu_layers else ""
        log(f"{label}{where} {ct} fa={fa} {length}: prefill {length / prefill_s:.0f} tok/s, full-cache decode {dec:.1f} tok/s, "
            f"KV {n_prompt * per_cell / 2**20:.1f} MiB")
        fresh = None  # (session, its saved state, cells): a context that only ever held that many cells
        for m in grid.methods:
            cls = get_method(m)
            if not cls.compresses or getattr(cls, "shifts_positions", False) or cls.tallies:
                continue
            reset_peak_rss()
            try:
                cs = protocol.compress_once(sess, pre, m, ratio=grid.ratio)
            except EdgekvError as e:
                log(f"  {m}: {e}")
                continue
            cells = sess.engine.n_cells
            peak = proc_status("VmHWM")  # this compression's, before a fresh context is made
            sess.feed([toks[-1]])  # logits to continue from (a restore drops them)
            if fresh is None or fresh[2] != cells:
                if fresh:
                    fresh[0].close()
                fresh = _fresh(model, toks[:cells], grid, ct, fa, Session, observe, moments)
            fresh[0].restore(fresh[1])
            fresh[0].feed([toks[cells]])
            dec, dec_fresh = decode_pair(sess, fresh[0], grid.decode_tokens)
            rows.append({**base, "mode": "oneshot", "method": m, "ratio": grid.ratio, "cells": cells,
                         "kv_bytes": cells * per_cell, "compress_s": round(cs, 4), "compressions": 1,
                         "overhead_pct": round(100 * cs / prefill_s, 2), "decode_tok_s": round(dec, 2),
                         "fresh_decode_tok_s": round(dec_fresh, 2), "prefill_s": round(prefill_s, 3),
                         "peak_rss_mib": round(peak, 1)})
            log(f"  {m}@{grid.ratio:g}: compress {cs * 1000:.0f} ms ({100 * cs / prefill_s:.1f}% of prefill), "
                f"{cells} cells, decode {dec:.1f} tok/s (a fresh {cells}-cell context, alternating: "
                f"{dec_fresh:.1f})")
        if fresh:
            fresh[0].close()
    if not grid.stream:
        return rows
    budget = max(64, math.floor(length * (1 - grid.ratio)))
    for m in grid.methods:
        cls = get_method(m)
        if not cls.compresses:
            continue
        shift = getattr(cls, "shifts_positions", False)
        kw = {"n_ctx": budget + 256} if shift else {"budget": budget, "n_ctx": budget + 256}
        try:
            sess = Session(model, method=m, chunk=256, **kv_kwargs(ct),
                           flash_attn=fa, n_threads=grid.threads, **kw)
        except EdgekvError as e:
            log(f"  stream {m}: {e}")
            continue
        with sess:
            reset_peak_rss()
            t0 = time.perf_counter()
            sess.feed(toks)
            total = time.perf_counter() - t0
            s = sess.stats
            dec = decode_rate(sess, grid.decode_tokens)
            ev = max(s.compressions, 1)
            rows.append({**base, "mode": "stream", "method": m, "ratio": grid.ratio, "budget": budget,
                         "n_ctx": sess.capacity, "cells": s.cells, "kv_bytes": s.cells * s.kv_bytes_per_cell,
                         "kv_bytes_allocated": sess.capacity * s.kv_bytes_per_cell,
                         "prefill_s": round(total, 3), "prefill_tok_s": round(length / total, 1),
                         "compressions": s.compressions, "compress_s": round(s.compress_seconds / ev, 4),
                         "compress_total_s": round(s.compress_seconds, 3),
                         "overhead_pct": round(100 * s.compress_seconds / total, 2),
                         "decode_tok_s": round(dec, 2), "peak_rss_mib": round(proc_status("VmHWM"), 1)})
            log(f"  stream {m} (n_ctx {sess.capacity}): {length / total:.0f} tok/s ingest, {s.compressions} events, "
                f"{1000 * s.compress_seconds / ev:.0f} ms each ({100 * s.compress_seconds / total:.1f}% of ingest), "
                f"decode {dec:.1f} tok/s")
    return rows
