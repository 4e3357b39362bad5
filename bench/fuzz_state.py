#!/usr/bin/env python3
"""Fuzz the state engine's parser: mutated llama.cpp sequence-state blobs through
``StateEngine.restore``, on the real model.

A real cache (SmolLM2, a prefill of 96 tokens; f16, or q8_0 with --cache-type) is saved
once; each mutant is that blob with one change: a header or cell field (magic, sequence,
stream and cell counts, a cell's position or sequence count, the V layout, the layer
count, a layer's K/V type or row size) set to an extreme or flipped, random bytes
anywhere, the blob cut short, or bytes added. Every mutant must be

    refused    a one-line ``EdgekvError`` before or from llama.cpp, after which the
               saved state restores byte for byte (nothing lost), or
    accepted   only if llama.cpp now holds exactly the mutant (sequence ids aside: llama.cpp
               restores into the sequence it is asked for) and the change is data: K or V
               bytes, which no parser can tell from a real cache's (random bytes in an f16
               key can even be infinite: session files carry a SHA-256 for that reason), or
               cell positions lowered (a cache compacted per head has cells at positions up
               to their earliest tokens; a position raised past them is refused)

Anything else fails the run: a Python exception of another kind, a refusal of more than
one line, an accepted structural change (cells at other positions than the token map
says: a silent wrong cache), or a crash (the run dies; the line ``trying ...`` before it
names the mutant). Reproducible from ``--seed``.

    .venv/bin/python bench/fuzz_state.py --count 2000 --json bench/results/fuzz_state.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

from edgekv.bench.mutate import apply, field_value


def structure(blob: bytes, n_cells: int) -> tuple[list[tuple[int, int, str]], int]:
    """The blob's header and per-layer fields as (offset, size, name), and where the first
    K rows start; follows ``edgekv.kvcache.layout`` (one stream with cells, one cache)."""
    from edgekv.kvcache import layout

    st = layout.parse_seq_state(blob, n_caches=1, n_layers=None)
    sec = st.sections[0]
    buf = np.frombuffer(blob, dtype=np.uint8)
    base = buf.ctypes.data
    out = [(0, 4, "magic"), (4, 4, "seq_id"), (8, 4, "n_stream"), (12, 4, "cell_count")]
    for c in sorted({0, 1, n_cells // 2, n_cells - 1}):
        out += [(16 + 12 * c, 4, f"cell {c} pos"), (20 + 12 * c, 4, f"cell {c} n_seq_id"),
                (24 + 12 * c, 4, f"cell {c} seq_id")]
    meta_end = 16 + 12 * n_cells
    out += [(meta_end, 4, "v_trans"), (meta_end + 4, 4, "n_layer")]
    for il, ld in enumerate(sec.layers):
        k_at = ld.k.ctypes.data - base
        v_at = ld.v.ctypes.data - base
        out += [(k_at - 12, 4, f"layer {il} k_type"), (k_at - 8, 8, f"layer {il} k_row_size"),
                (v_at - 12, 4, f"layer {il} v_type")]
        if sec.v_trans:
            out += [(v_at - 8, 4, f"layer {il} v_elem_size"), (v_at - 4, 4, f"layer {il} n_embd_v")]
        else:
            out += [(v_at - 8, 8, f"layer {il} v_row_size")]
    return out, sec.layers[0].k.ctypes.data - base - 12


def mutation(rng: random.Random, blob: bytes, fields: list[tuple[int, int, str]], payload: int) -> dict:
    kind = rng.choice(["field", "field", "field", "flip", "bytes", "truncate", "append"])
    if kind == "field":
        at, size, name = rng.choice(fields)
        return {**field_value(rng, blob, at, size), "field": name}
    if kind == "flip":
        at = rng.randrange(payload if rng.random() < 0.7 else len(blob))
        return {"kind": kind, "at": at, "bytes": bytes([blob[at] ^ (1 << rng.randrange(8))]).hex()}
    if kind == "bytes":
        at = rng.randrange(len(blob))
        return {"kind": kind, "at": at, "bytes": rng.randbytes(rng.randint(1, 8)).hex()}
    if kind == "truncate":
        return {"kind": kind, "size": rng.randrange(len(blob))}
    return {"kind": "append", "bytes": rng.randbytes(rng.choice([1, 4, 12, 100])).hex()}


def without_seq_ids(blob: bytes, n_cells: int) -> bytes:
    """The blob with its sequence ids zeroed: llama.cpp restores into the sequence it is
    asked for, whatever ids the blob names, and writes its own back."""
    b = bytearray(blob)
    b[4:8] = bytes(4)
    for c in range(n_cells):
        b[24 + 12 * c : 28 + 12 * c] = bytes(4)
    return bytes(b)


def lowered_positions(blob: bytes, mutant: bytes, n_cells: int) -> bool:
    """Whether the mutant differs from the blob only in cell positions, each lowered: a
    cache compacted per head holds its cells at positions up to their earliest tokens, so
    these are indistinguishable from a real cache's (raised ones are refused)."""
    if len(blob) != len(mutant):
        return False
    a, b = bytearray(blob), bytearray(mutant)
    meta = slice(16, 16 + 12 * n_cells)
    old = np.frombuffer(bytes(a[meta]), "<i4").reshape(n_cells, 3)[:, 0]
    new = np.frombuffer(bytes(b[meta]), "<i4").reshape(n_cells, 3)[:, 0]
    a[meta], b[meta] = bytes(12 * n_cells), bytes(12 * n_cells)
    return without_seq_ids(bytes(a), n_cells) == without_seq_ids(bytes(b), n_cells) and bool(np.all(new <= old))


def structural(m: dict, fields: list[tuple[int, int, str]], payload: int, n_cells: int) -> bool:
    """Whether the mutation touches the blob's structure or its cell positions (anything but
    K/V bytes and sequence ids)."""
    if m["kind"] in ("truncate", "append"):
        return True
    lo, hi = m["at"], m["at"] + len(bytes.fromhex(m["bytes"]))
    ids = [(4, 4), *((24 + 12 * c, 4) for c in range(n_cells))]
    touched = [(at, size) for at, size, _ in fields if lo < at + size and at < hi]
    if lo < payload:
        touched += [(at, 1) for at in range(lo, min(hi, payload))]
    return any(not any(a <= at < a + s for a, s in ids) for at, _ in touched)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cache-type", default="f16", help="K and V cache type")
    ap.add_argument("--flash-attn", default="on", help="off: V stored transposed")
    ap.add_argument("--count", type=int, default=500)
    ap.add_argument("--seconds", type=float, default=0, help="stop after this long (0: no limit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from edgekv.errors import EdgekvError
    from edgekv.kvcache.engine import CacheState
    from edgekv.kvcache.state import StateEngine
    from edgekv.llama import Context, Model
    from edgekv.models import resolve_model

    model = Model(resolve_model(a.model))
    ctx = Context(model, n_ctx=256, cache_type_k=a.cache_type, cache_type_v=a.cache_type, flash_attn=a.flash_attn,
                  n_threads=2)
    eng = StateEngine(ctx)
    toks = model.tokenize("The keeper of the lighthouse wrote down every ship that passed. " * 12)[:96]
    eng.reset()
    eng.decode(toks, 0)
    good = eng.save()
    blob = bytes(good.blob)
    fields, payload = structure(blob, len(toks))
    rng = random.Random(a.seed)
    counts: dict[str, int] = {}
    failures: list[dict] = []
    t0 = time.time()
    done = 0
    for i in range(a.count):
        if a.seconds and time.time() - t0 > a.seconds:
            break
        m = mutation(rng, blob, fields, payload)
        mutant = apply(blob, m)
        if mutant == blob:
            continue
        print(f"trying #{i} {json.dumps(m)}", file=sys.stderr, flush=True)
        state = CacheState(blob=mutant, token_pos=good.token_pos, engine="state", ids=good.ids)
        outcome, why = "refused", ""
        try:
            eng.restore(state)
            held = bytes(ctx.state_get())
            if without_seq_ids(held, len(toks)) != without_seq_ids(mutant, len(toks)):
                outcome, why = "bad", "accepted, but llama.cpp holds something else than the blob"
            elif structural(m, fields, payload, len(toks)):
                if lowered_positions(blob, mutant, len(toks)):
                    outcome = "accepted, a position lowered"
                else:
                    outcome, why = "bad", f"a structural change was accepted ({m.get('field', m['kind'])})"
            else:
                outcome = "accepted"
                eng.decode(toks[:1], int(ctx.pos_max()) + 1)
                if not np.isfinite(ctx.logits()).all():  # K/V bytes are data: only a checksum
                    outcome = "accepted, non-finite K/V"  # (session files have one) tells them
        except EdgekvError as e:
            if "\n" in str(e) or not str(e):
                outcome, why = "bad", f"refusal not one line: {e!r}"
        except Exception as e:  # another kind: a parser bug
            outcome, why = "bad", f"{type(e).__name__}: {e}"
        try:  # nothing is lost: the good state goes back in, byte for byte
            eng.restore(good)
            if bytes(ctx.state_get()) != blob:
                outcome, why = "bad", "the saved state no longer restores byte for byte"
        except Exception as e:
            outcome, why = "bad", f"the saved state no longer restores: {type(e).__name__}: {e}"
        counts[outcome] = counts.get(outcome, 0) + 1
        done += 1
        if outcome == "bad":
            failures.append({"n": i, "mutation": m, "why": why})
            print(f"FAIL #{i} {json.dumps(m)}: {why}", flush=True)
        if done % 100 == 0:
            print(f"{done} mutants, {time.time() - t0:.0f} s: {counts}", flush=True)
    ctx.close()
    result = {"model": model.path.name, "cache_type": a.cache_type, "flash_attn": a.flash_attn, "seed": a.seed,
              "mutants": done, "seconds": round(time.time() - t0, 1), "counts": counts, "failures": failures,
              "ok": not failures}
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
