#!/usr/bin/env python3
"""The same benchmarks on two checkouts, interleaved: did a change move the times?

A refactor must not change speed. This runs the ingest benchmark (``edgekv bench
speed``: a full prefill, one compression per method, then the text streamed
through a bounded cache) and the server load test (``bench/server_load.py``) on
an old and a new checkout in turns (old, new, old, new, ...), each checkout with
its own ``.venv``, so drift of the machine falls on both alike. Per measure it
reports both sides' medians and their ratio.

    git worktree add /tmp/old OLD_COMMIT && (cd /tmp/old && EDGEKV_SKIP_MODEL=1 bash scripts/setup.sh)
    .venv/bin/edgekv bench run ab_commits --old /tmp/old --rounds 2
writes bench/results/ab_commits.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEED = ["--methods", "streaming_llm,knorm,random,lagkv", "--lengths", "8k", "--ratio", "0.875"]
# what each part reports, per row key: (measure, field)
SPEED_FIELDS = ("prefill_tok_s", "compress_s", "decode_tok_s")
LOAD_FIELDS = ("wall_s", "completion_tok_s", "turn_s_median", "first_token_s_median")


def commit(tree: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True,
                          text=True).stdout.strip() or "?"


def run_speed(tree: Path, out: Path, threads: int | None) -> dict[str, float]:
    cmd = [str(tree / ".venv" / "bin" / "edgekv"), "bench", "speed", *SPEED, "--no-report", "--out", str(out),
           *(["--threads", str(threads)] if threads else [])]
    subprocess.run(cmd, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    got = {}
    for line in (out / "speed.jsonl").read_text().splitlines():
        r = json.loads(line)
        for f in SPEED_FIELDS:
            if f in r and not (f == "prefill_tok_s" and r["mode"] == "oneshot" and r["method"] != "full"):
                got[f"{r['mode']}/{r['method']}/{f}"] = float(r[f])
    return got


def run_load(tree: Path, out: Path, threads: int | None) -> dict[str, float]:
    path = out / "server_load.json"
    cmd = [str(tree / ".venv" / "bin" / "python"), "bench/server_load.py", "--json", str(path),
           *(["--threads", str(threads)] if threads else [])]
    subprocess.run(cmd, cwd=tree, check=True, stderr=subprocess.DEVNULL)
    r = json.loads(path.read_text())
    if not r["ok"]:
        raise SystemExit(f"server_load failed on {tree}")
    return {f"server_load/{f}": float(r[f]) for f in LOAD_FIELDS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="the old checkout (with its own .venv)")
    ap.add_argument("--new", type=Path, default=ROOT, help="the new checkout (default: this one)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per side, interleaved")
    ap.add_argument("--parts", default="speed,server_load")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="ab_commits", help="result name under bench/results")
    a = ap.parse_args()

    from edgekv.bench.results import machine, write_json

    parts = {"speed": run_speed, "server_load": run_load}
    todo = [p for p in a.parts.split(",") if p]
    if unknown := set(todo) - set(parts):
        raise SystemExit(f"unknown parts {sorted(unknown)}; use {', '.join(parts)}")
    sides = {"old": a.old.resolve(), "new": a.new.resolve()}
    for name, tree in sides.items():
        if not (tree / ".venv" / "bin" / "edgekv").exists():
            raise SystemExit(f"{name} checkout {tree} has no .venv (run scripts/setup.sh there)")
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for name, tree in sides.items():  # old, new, old, new, ...
                got: dict[str, float] = {}
                for part in todo:
                    out = Path(tmp) / f"{name}-{rnd}-{part}"
                    out.mkdir()
                    print(f"[{time.perf_counter() - t0:6.0f} s] round {rnd + 1}/{a.rounds}: {part} on {name} "
                          f"({commit(tree)})", file=sys.stderr, flush=True)
                    got |= parts[part](tree, out, a.threads)
                runs[name].append(got)
    rows = []
    for key in sorted(set(runs["old"][0]) & set(runs["new"][0])):
        old = statistics.median(r[key] for r in runs["old"])
        new = statistics.median(r[key] for r in runs["new"])
        rows.append({"measure": key, "old": old, "new": new, "new_over_old": round(new / old, 3) if old else None,
                     "old_runs": [r[key] for r in runs["old"]], "new_runs": [r[key] for r in runs["new"]]})
        print(f"{key:45s} old {old:10.4g}  new {new:10.4g}  new/old {rows[-1]['new_over_old']}")
    payload = {"machine": machine(), "command": " ".join(["bench/ab_commits.py", *sys.argv[1:]]),
               "old": commit(sides["old"]), "new": commit(sides["new"]), "rounds": a.rounds,
               "speed_args": SPEED, "wall_s": round(time.perf_counter() - t0, 1), "rows": rows}
    print(write_json(a.out, payload), file=sys.stderr)


if __name__ == "__main__":
    main()
