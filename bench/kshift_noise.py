#!/usr/bin/env python3
"""How far edgekv's renumbering (``+rerotate``) is from llama.cpp's own K-shift, next to
what rounding noise and a real bug do to the same next-token distribution.

The setting of ``tests/test_rerotate.py``: 300 tokens, StreamingLLM down to 100 cells,
then the cells renumbered 0..99 two ways, by edgekv (``streaming_llm+rerotate``:
dequantise, rotate in float, re-quantise on the host) and by llama.cpp
(``llama_memory_seq_add``, its K-shift graph at the next decode); then the same two
tokens are fed to both and their next-token distributions compared. Beside that pair:

- ``noise``: edgekv's cache with a random fraction (``--flips``) of its q8_0 K codes moved
  one step (what re-quantising a rotated key does to a code that lies near a rounding
  boundary), against the same cache unflipped; one row per (fraction, seed);
- ``bug``: llama.cpp's cache given the positions 0..99 without rotating its keys (what a
  renumbering that forgets the rotation would leave), against llama.cpp's K-shift.

Each row records KL(p_ref || p) in nats, the largest logit difference, the gap between
the two largest logits of each side, and whether the most likely token agrees, with the
CPU features the loaded ggml runs. Run it once per kernel set (``bash
scripts/test_kernels.sh`` builds the AVX2 one under ``build/cpu-avx2``)::

    .venv/bin/edgekv bench run kshift_noise
    build/cpu-avx2/.venv/bin/python bench/kshift_noise.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from edgekv.bench.results import RESULTS, machine

TEXT = " ".join(f"Line {i}: the lighthouse keeper counted {i * 7 % 13} ships at dusk." for i in range(40))


def compare(ref: np.ndarray, got: np.ndarray) -> dict:
    """KL(ref || got), the largest logit difference, each side's top-2 gap, top-1 agreement."""
    from edgekv.bench.scoring import kl_top1, log_softmax

    kl, top1 = kl_top1(log_softmax(ref)[None], log_softmax(got)[None])

    def gap(x: np.ndarray) -> float:
        a, b = np.sort(x)[-2:]
        return float(b - a)

    return {"kl": kl, "max_abs_logit_diff": float(np.abs(ref - got).max()), "top2_gap_ref": gap(ref),
            "top2_gap": gap(got), "top1_agrees": bool(top1 == 1.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cache-types", default="f16,q8_0")
    ap.add_argument("--engines", default="state,native")
    ap.add_argument("--seeds", type=int, default=5, help="noise rows per cache type")
    ap.add_argument("--flips", default="0,0.00001,0.0001,0.01", help="fractions of q8_0 K codes moved one step (0: the control)")
    ap.add_argument("--out", type=Path, default=RESULTS / "kshift_noise.jsonl")
    a = ap.parse_args()

    from edgekv.kvcache import layout
    from edgekv.llama import Model, cpu_features
    from edgekv.models import resolve_model
    from edgekv.session import Session

    model = Model(resolve_model(a.model))
    toks = model.tokenize(TEXT)[:300]
    nxt = model.tokenize(" The keeper", add_special=False)
    env = {**machine(), "cpu_features": cpu_features()}
    rows = []

    def renumber_by_llama_cpp(s: Session, rotate: bool = True) -> None:
        pos = np.sort(s.engine.cell_positions())
        if rotate:
            runs = np.flatnonzero(np.diff(pos) != 1) + 1
            for start, end in zip(np.r_[0, runs], np.r_[runs, pos.size], strict=True):
                if pos[start] != start:
                    s.ctx.seq_add(s.engine.seq, int(pos[start]), int(pos[end - 1]) + 1, int(start - pos[start]))
        else:  # the positions only: the keys keep the rotation of their old positions
            st = layout.parse_seq_state(s.ctx.state_get(s.engine.seq), n_caches=1, n_layers=None)
            sec = st.sections[0]
            new = np.empty_like(sec.pos)
            new[np.argsort(sec.pos, kind="stable")] = np.arange(sec.pos.size, dtype=sec.pos.dtype)
            sec.pos = new
            s.ctx.state_set(layout.write_seq_state(st), s.engine.seq)
        s.n_past = int(pos.size)

    def k_codes(s: Session) -> list[np.ndarray]:
        """Each layer's q8_0 K codes [cells in position order, codes] (scales left out)."""
        sec = layout.parse_seq_state(s.ctx.state_get(s.engine.seq), n_caches=1, n_layers=None).sections[0]
        order = np.argsort(sec.pos, kind="stable")
        return [np.array(ld.k)[order].reshape(sec.pos.size, -1, 34)[:, :, 2:] for ld in sec.layers]

    def flip_k_codes(s: Session, rng: np.random.Generator, flip: float) -> None:
        """Move a fraction of the q8_0 K codes one step (blocks: a 2-byte scale, 32 int8 codes)."""
        st = layout.parse_seq_state(s.ctx.state_get(s.engine.seq), n_caches=1, n_layers=None)
        for ld in st.sections[0].layers:
            raw = np.array(ld.k).reshape(-1, 34)
            codes = raw[:, 2:].view(np.int8)
            hit = rng.random(codes.shape) < flip
            step = np.where(rng.random(codes.shape) < 0.5, -1, 1).astype(np.int16)
            codes[...] = np.clip(codes.astype(np.int16) + np.where(hit, step, 0), -127, 127).astype(np.int8)
            ld.k = raw.reshape(np.asarray(ld.k).shape)
        s.ctx.state_set(layout.write_seq_state(st), s.engine.seq)

    for ct in a.cache_types.split(","):
        for engine in a.engines.split(","):
            kw = dict(n_ctx=384, chunk=128, engine=engine, cache_type_k=ct, cache_type_v=ct, n_threads=2)
            with Session(model, method="streaming_llm+rerotate", **kw) as ours, \
                    Session(model, method="streaming_llm", **kw) as theirs, \
                    Session(model, method="streaming_llm", **kw) as unrotated:
                for s in (ours, theirs, unrotated):
                    s.feed(toks)
                    s.compress(100)
                renumber_by_llama_cpp(theirs)
                renumber_by_llama_cpp(unrotated, rotate=False)
                saved = ours.save()
                logits = {}
                for name, s in (("ours", ours), ("theirs", theirs), ("unrotated", unrotated)):
                    s.feed(nxt)
                    logits[name] = s.logits().copy()
                pair = {"cache_type": ct, "engine": engine, "kind": "pair"}
                if ct == "q8_0":  # the renumbered cells' codes that the two re-quantisations left apart
                    differ = [(x[:100] != y[:100]).mean() for x, y in zip(k_codes(ours), k_codes(theirs), strict=True)]
                    pair["k_codes_differ"] = float(np.mean(differ))
                rows.append({**pair, **compare(logits["theirs"], logits["ours"])})
                rows.append({"cache_type": ct, "engine": engine, "kind": "bug",
                             **compare(logits["theirs"], logits["unrotated"])})
                if ct == "q8_0" and engine == a.engines.split(",")[0]:
                    for flip in map(float, a.flips.split(",")):
                        for seed in range(a.seeds):
                            ours.restore(saved)
                            flip_k_codes(ours, np.random.default_rng(seed), flip)
                            ours.feed(nxt)
                            rows.append({"cache_type": ct, "engine": engine, "kind": "noise", "seed": seed,
                                         "flip": flip, **compare(logits["ours"], ours.logits())})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("a") as f:
        for r in rows:
            f.write(json.dumps({**r, **env}) + "\n")
    feats = " ".join(env["cpu_features"])
    print(f"cpu features: {feats}")
    print(f"{'cache':6} {'engine':7} {'kind':6} {'K codes':>8} {'KL (nats)':>10} {'max|dlogit|':>11} "
          f"{'gap ref':>8} {'gap':>8} top1")
    for r in rows:
        codes = r.get("k_codes_differ", r.get("flip"))
        print(f"{r['cache_type']:6} {r['engine']:7} {r['kind']:6} {'' if codes is None else f'{codes:.1e}':>8} "
              f"{r['kl']:10.2e} {r['max_abs_logit_diff']:11.3f} {r['top2_gap_ref']:8.3f} {r['top2_gap']:8.3f} "
              f"{'yes' if r['top1_agrees'] else 'NO'}")
    print(f"appended {len(rows)} rows to {a.out}")


if __name__ == "__main__":
    main()
