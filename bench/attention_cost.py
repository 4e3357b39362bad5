#!/usr/bin/env python3
"""What attention-scored methods cost: scoring per compression, ChunkKV's layer reuse, H2O's decode.

Three measurements on the default model (f16, flash attention off, 2 threads),
each side by side in one run, rounds interleaved, medians reported:

- **compress**: one compression to half the cells of a prefilled context
  (restored from one saved prefill each time), per method and engine. The
  time includes reading K/V or scoring on the device, the selection and the
  compaction. knorm (no queries) is the baseline.
- **reuse**: ChunkKV with ``reuse=1`` against ``reuse=2`` and ``4``: the
  same compression, and how many layers were scored.
- **decode**: tokens/s of 48 greedy decodes after a prefill (and the prefill's
  own time), with no recording, recording the observation window (SnapKV,
  ChunkKV) and tallying the attention of every query (H2O), per engine. The
  tally runs both ways: summed from llama.cpp's own softmax as it decodes (the
  default without flash attention) and "rescored", each decode's queries
  scored again over the cache (``EDGEKV_TALLY=rescore``; what flash attention
  still needs).

    .venv/bin/edgekv bench run attention_cost --lengths 1024,4096 --rounds 3
writes bench/results/attention_cost.json (``--only decode``: the decode rows alone,
into ``--out``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from edgekv import Session
from edgekv.bench import protocol
from edgekv.bench.results import machine, write_json
from edgekv.bench.speed import long_text_tokens
from edgekv.llama import Model
from edgekv.methods import get_method
from edgekv.models import resolve_model

PER_HEAD = {"per_layer": False, "chunk": 10, "window": 32}  # ChunkKV's rule that layer reuse speeds up
COMPRESS = [("knorm", {}), ("snapkv", {}), ("chunkkv", PER_HEAD), ("h2o", {})]
REUSE = [1, 2, 4]
DECODE = [("none", 0, False, ""), ("window", 64, False, ""), ("tally", 64, True, ""),
          ("tally rescored", 64, True, "rescore")]  # the last: EDGEKV_TALLY


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def compress_costs(model: Model, toks: list[int], engine: str, rounds: int, log) -> dict:
    n = len(toks)
    out: dict[str, list[float]] = {}
    scored: dict[str, int] = {}
    with Session(model, method="full", n_ctx=n + 64, chunk=512, engine=engine, n_threads=2,
                 flash_attn="off", observe=64, tally=True) as s:
        pre = protocol.prefill(s, toks)
        log(f"  {engine} L={n}: prefill {pre.seconds:.1f} s (recording window and tally)")
        cases = [(f"{m}", get_method(m, **p)) for m, p in COMPRESS]
        cases += [(f"chunkkv reuse={r}", get_method("chunkkv", reuse=r, **PER_HEAD)) for r in REUSE]
        for r in range(rounds):
            for name, m in cases if r % 2 == 0 else cases[::-1]:
                s.restore(pre.saved)
                s.use(m)
                t0 = time.perf_counter()
                snap = s.engine.snapshot()
                keep = m.select(snap, n // 2)
                s.engine.compact(keep)
                out.setdefault(name, []).append(time.perf_counter() - t0)
                scored[name] = len(set(snap.scored_layers))
        for name, v in out.items():
            log(f"    {name}: {1000 * statistics.median(v):.0f} ms, {scored[name]} layers scored")
    return {name: {"seconds": _median(v), "runs": [round(x, 4) for x in v], "layers_scored": scored[name]}
            for name, v in out.items()}


def decode_costs(model: Model, toks: list[int], engine: str, rounds: int, log) -> dict:
    n = len(toks)
    out: dict[str, list[float]] = {}
    prefill: dict[str, list[float]] = {}
    for r in range(rounds):
        for name, window, tally, how in DECODE if r % 2 == 0 else DECODE[::-1]:
            preset = os.environ.get("EDGEKV_TALLY")
            os.environ["EDGEKV_TALLY"] = how
            try:
                with Session(model, method="full", n_ctx=n + 64, chunk=512, engine=engine, n_threads=2,
                             flash_attn="off", observe=window, tally=tally) as s:
                    t0 = time.perf_counter()
                    s.feed(toks)
                    prefill.setdefault(name, []).append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    got = sum(1 for _ in s.generate_tokens(48))
                    out.setdefault(name, []).append(got / (time.perf_counter() - t0))
            finally:  # a value set before the run is put back
                if preset is None:
                    os.environ.pop("EDGEKV_TALLY")
                else:
                    os.environ["EDGEKV_TALLY"] = preset
    rows = {name: {"decode_tok_s": round(statistics.median(v), 2), "runs": [round(x, 2) for x in v],
                   "prefill_s": _median(prefill[name])}
            for name, v in out.items()}
    for name in ("window", "tally", "tally rescored"):
        ratios = [x / o for x, o in zip(out[name], out["none"], strict=True)]
        rows[name]["vs_none"] = round(statistics.median(ratios), 3)
    ratios = [x / o for x, o in zip(out["tally"], out["tally rescored"], strict=True)]
    rows["tally"]["vs_rescored"] = round(statistics.median(ratios), 3)
    log(f"  {engine} L={n} decode tok/s: " + ", ".join(f"{k} {v['decode_tok_s']}" for k, v in rows.items()))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default="native,state")
    ap.add_argument("--only", choices=["compress", "decode"], default=None, help="one of the measurements")
    ap.add_argument("--out", default="attention_cost", help="results name under bench/results")
    a = ap.parse_args()
    model = Model(resolve_model(None))
    result: dict = {"machine": machine(), "rounds": a.rounds, "compress": {}, "decode": {}}
    for length in (int(x) for x in a.lengths.split(",")):
        toks = long_text_tokens(model, length)
        for engine in a.engines.split(","):
            print(f"L={length} engine={engine}", flush=True)
            if a.only != "decode":
                result["compress"][f"{engine} {length}"] = compress_costs(model, toks, engine, a.rounds, print)
            if a.only != "compress":
                result["decode"][f"{engine} {length}"] = decode_costs(model, toks, engine, a.rounds, print)
            write_json(a.out, result)  # after every step: a stopped run keeps what it measured
    model.close()
    print(f"wrote {write_json(a.out, result)}")


if __name__ == "__main__":
    main()
