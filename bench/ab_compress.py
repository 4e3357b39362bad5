#!/usr/bin/env python3
"""One-shot compressions on two checkouts, interleaved: did a change make a method faster?

The machine's speed drifts by tens of percent within an hour, so times measured
minutes apart do not compare. Here one worker process per checkout prefills the
same text once (``--length`` tokens, recording what the methods read), keeps the
state, and then the two take turns: per round and method, each restores its state
and compresses it one-shot under ``--ratio``, old and new in alternating order.
Per method and cache type it reports both medians and the median of the per-round
ratios new / old.

    git worktree add /tmp/old OLD_COMMIT && cp edgekv/_edgekv_*.so /tmp/old/edgekv/
    .venv/bin/edgekv bench run ab_compress --old /tmp/old --methods expected_attention,lagkv --rounds 5

The old checkout runs on this checkout's Python and compiled modules (copy them, as
above, when the C sources did not change between the two). When they did, give the old
checkout its own build: a copy of ``.venv`` with the old wheel installed and the old
checkout's bindings built by it, passed as ``--old-python``:

    cp -a .venv /tmp/oldvenv && /tmp/oldvenv/bin/python -m pip install --force-reinstall --no-deps OLD_WHEEL
    (cd /tmp/old && /tmp/oldvenv/bin/python native/build_native.py)
    .venv/bin/edgekv bench run ab_compress --old /tmp/old --old-python /tmp/oldvenv/bin/python ...

(``python -m pip``, not the copy's ``bin/pip``: a copied venv's scripts still name the
original interpreter, so its ``pip`` would reinstall the old wheel into ``.venv``.)

Each compression also reports a digest of the cache's state blob, so the results say
whether the two checkouts left the same bytes (``same_state``). Writes
bench/results/ab_compress.json (``--out NAME``: NAME.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# what each worker runs: the public API both checkouts share
WORKER = r"""
import hashlib, json, sys, time
from edgekv.bench.speed import long_text_tokens
from edgekv.llama import Model
from edgekv.methods import METHODS
from edgekv.models import resolve_model
from edgekv.session import Session
model_name, ct, length, ratio, names = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5:]
model = Model(resolve_model(model_name))
toks = long_text_tokens(model, length)
observe = max(METHODS[m]().queries_needed for m in names)
moments = any(METHODS[m].query_statistics for m in names)
with Session(model, method="full", n_ctx=length + 64, chunk=512, cache_type_k=ct, cache_type_v=ct,
             observe=observe, moments=moments) as s:
    s.feed(toks)
    state = s.save()
    print("ready", flush=True)
    for line in sys.stdin:
        m = line.strip()
        s.restore(state)
        s.use(m, ratio=ratio, scheduled=False)
        t0 = time.perf_counter()
        s.compress()
        dt = time.perf_counter() - t0
        digest = hashlib.sha256(s.ctx.state_get()).hexdigest()[:16]
        print(json.dumps({"method": m, "seconds": dt, "cells": s.engine.n_cells, "state": digest}), flush=True)
"""


class Worker:
    def __init__(self, tree: Path, args: list[str], python: str = sys.executable) -> None:
        env = dict(os.environ, PYTHONPATH=str(tree))
        self.p = subprocess.Popen([python, "-c", WORKER, *args], cwd=tree, env=env, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def wait_ready(self) -> None:
        line = self.p.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"a worker failed to start (exit {self.p.poll()})")

    def compress(self, method: str) -> dict:
        self.p.stdin.write(method + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"a worker died compressing with {method}")
        return json.loads(line)

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the other checkout")
    ap.add_argument("--old-python", default=sys.executable,
                    help="the interpreter for the old checkout (its own venv when the C sources differ)")
    ap.add_argument("--new", default=str(ROOT))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="expected_attention,lagkv")
    ap.add_argument("--cache-types", default="f16,q8_0")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--ratio", type=float, default=0.875)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="ab_compress", help="results name under bench/results (JSON)")
    a = ap.parse_args()
    from edgekv.bench.results import machine, write_json

    trees = {"old": Path(a.old).resolve(), "new": Path(a.new).resolve()}
    commits = {k: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=t, capture_output=True,
                                 text=True).stdout.strip() for k, t in trees.items()}
    names = a.methods.split(",")
    rows = []
    for ct in a.cache_types.split(","):
        print(f"{ct}: prefilling {a.length} tokens in both checkouts", flush=True)
        python = {"old": a.old_python, "new": sys.executable}
        workers = {k: Worker(t, [a.model, ct, str(a.length), str(a.ratio), *names], python[k])
                   for k, t in trees.items()}
        for w in workers.values():
            w.wait_ready()
        times: dict[str, dict[str, list[float]]] = {m: {"old": [], "new": []} for m in names}
        cells: dict[str, dict[str, int]] = {m: {} for m in names}
        states: dict[str, dict[str, set[str]]] = {m: {"old": set(), "new": set()} for m in names}
        for r in range(a.rounds):
            for m in names if r % 2 == 0 else names[::-1]:
                for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                    got = workers[side].compress(m)
                    times[m][side].append(got["seconds"])
                    cells[m][side] = got["cells"]
                    states[m][side].add(got["state"])
                print(f"round {r + 1}/{a.rounds} {ct} {m}: old {times[m]['old'][-1]:.3f} s, "
                      f"new {times[m]['new'][-1]:.3f} s", flush=True)
        for w in workers.values():
            w.close()
        for m in names:
            if cells[m]["old"] != cells[m]["new"]:
                raise SystemExit(f"{m} {ct}: the checkouts kept {cells[m]['old']} and {cells[m]['new']} cells")
            ratio = statistics.median(n / o for n, o in zip(times[m]["new"], times[m]["old"], strict=True))
            rows.append({"method": m, "cache_type": ct, "cells_after": cells[m]["new"],
                         "old_s": round(statistics.median(times[m]["old"]), 3),
                         "new_s": round(statistics.median(times[m]["new"]), 3),
                         "new_over_old": round(ratio, 3), "same_state": states[m]["old"] == states[m]["new"],
                         "raw": times[m]})
    out = write_json(a.out, {"machine": machine(), "commits": commits, "model": a.model, "length": a.length,
                                     "ratio": a.ratio, "rounds": a.rounds, "command": " ".join(sys.argv), "rows": rows})
    print(f"{'method':18s} {'cache':6s} {'old s':>7s} {'new s':>7s} {'new/old':>8s} same state")
    for row in rows:
        print(f"{row['method']:18s} {row['cache_type']:6s} {row['old_s']:7.3f} {row['new_s']:7.3f} "
              f"{row['new_over_old']:8.3f} {row['same_state']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
