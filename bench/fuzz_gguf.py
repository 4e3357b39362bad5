#!/usr/bin/env python3
"""Fuzz the GGUF loaders a user reaches: mutated headers of a real model through
``edgekv info``, ``edgekv generate`` and ``edgekv serve``.

Each mutant is the model with its header changed: a flipped bit, a few random bytes,
a length, count, type, dimension or value field set to an extreme (0, 1, the type's
maximum, 2^31, one off), or the file cut short. Every command runs in a child process
forked from this one (which never starts llama.cpp itself), so a crash inside
llama.cpp is seen as the child's signal, a hang as its timeout. Each outcome is one of

    answered   exit 0 (the mutation was harmless: bytes inside a token string, say)
    refused    exit 2 with exactly one ``edgekv: error:`` line
    traceback  a Python traceback          } failures: the run says so and exits 1,
    crash      killed by a signal          } and each failing mutation is written as
    hang       past the timeout            } a seed to replay (--seeds)
    other      anything else

The mutations are reproducible from ``--seed``; committed seeds of past failures
(``tests/data/fuzz_gguf_seeds.json``) are replayed first with ``--replay``.

    .venv/bin/python bench/fuzz_gguf.py --count 400 --json bench/results/fuzz_gguf.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from edgekv.bench.mutate import apply, field_value


def fields(path: Path) -> tuple[list[list[tuple[int, int]]], int]:
    """Every header field as its scalar parts' (offset, size), and where tensor data starts.
    A field's first parts are its key's length and bytes, then its type, then its value (for
    arrays: the element type, the count, then each element); a tensor's are its name, dims,
    type and data offset."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(str(path))
    base = r.data.ctypes.data
    out: list[list[tuple[int, int]]] = []
    for f in [*r.fields.values(), *(t.field for t in r.tensors)]:
        parts = []
        for p in f.parts[:64]:  # a long array's first elements stand for the rest
            if isinstance(p, np.ndarray) and p.size == 1 and p.dtype.itemsize in (1, 2, 4, 8):
                parts.append((p.ctypes.data - base, p.dtype.itemsize))
        if parts:
            out.append(parts)
    return out, int(r.data_offset)


def mutation(rng: random.Random, data: bytes, layout: list[list[tuple[int, int]]], header: int) -> dict:
    """One random mutation, as a recipe ``apply`` replays: {"kind", "at", "bytes" | "size"}."""
    kind = rng.choice(["flip", "bytes", "field", "field", "field", "truncate"])
    if kind == "flip":
        at = rng.randrange(header)
        return {"kind": kind, "at": at, "bytes": bytes([data[at] ^ (1 << rng.randrange(8))]).hex()}
    if kind == "bytes":
        at = rng.randrange(header)
        return {"kind": kind, "at": at, "bytes": rng.randbytes(rng.randint(1, 4)).hex()}
    if kind == "truncate":
        return {"kind": kind, "size": rng.randrange(header) if rng.random() < 0.8 else rng.randrange(len(data))}
    at, size = rng.choice(rng.choice(layout))
    return field_value(rng, data, at, size)


def run_forked(argv: list[str], timeout: float, serve_port: int | None = None) -> dict:
    """``edgekv argv`` in a forked child; its outcome (see the module docstring). For serve,
    a server that answers /v1/models is stopped with SIGTERM and counts as answered."""
    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # the child: edgekv's own entry point, its output to the files
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            os.environ.pop("EDGEKV_VERBOSE", None)
            os.environ.update(COLUMNS="200", NO_COLOR="1", TERM="dumb")
            sys.argv = ["edgekv", *argv]
            from edgekv.cli import app

            try:
                app(standalone_mode=True)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    t0 = time.time()
    status, answered = None, False
    while time.time() - t0 < timeout:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
            break
        if serve_port is not None and not answered:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{serve_port}/v1/models", timeout=2):
                    answered = True
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        time.sleep(0.02)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return {"outcome": "hang", "seconds": round(time.time() - t0, 2)}
    err.seek(0)
    stderr = err.read().decode(errors="replace")
    lines = stderr.splitlines()
    res = {"seconds": round(time.time() - t0, 2)}
    if answered and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM:
        return {**res, "outcome": "answered"}  # uvicorn re-raises the SIGTERM it stopped on
    if os.WIFSIGNALED(status):
        return {**res, "outcome": "crash", "signal": signal.Signals(os.WTERMSIG(status)).name,
                "stderr": stderr[-1500:]}
    rc = os.WEXITSTATUS(status)
    if "Traceback" in stderr:
        return {**res, "outcome": "traceback", "stderr": stderr[-1500:]}
    if rc == 0 or answered:
        return {**res, "outcome": "answered"}
    if rc == 2 and len(lines) == 1 and lines[0].startswith("edgekv: error: "):
        return {**res, "outcome": "refused", "line": lines[0]}
    return {**res, "outcome": "other", "rc": rc, "stderr": stderr[-1500:]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


COMMANDS = {
    "info": lambda p: (["info", str(p)], None),
    "generate": lambda p: (["generate", str(p), "--prompt", "hi", "--max-tokens", "1", "--threads", "2"], None),
    "serve": lambda p: (lambda port: (["serve", str(p), "--port", str(port), "--threads", "2"], port))(free_port()),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="the model whose header is mutated")
    ap.add_argument("--count", type=int, default=200, help="random mutants (each through every command)")
    ap.add_argument("--seconds", type=float, default=0, help="stop making mutants after this long (0: no limit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commands", default="info,generate,serve", help="comma-separated; serve runs every 4th mutant")
    ap.add_argument("--timeout", type=float, default=60, help="seconds before a command counts as hung")
    ap.add_argument("--replay", default=None, help="a JSON list of {name, mutations} replayed first")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--seeds", default=None, help="write each failing mutant's recipe here (JSON)")
    a = ap.parse_args()

    from edgekv.models import resolve_model

    src = resolve_model(a.model)
    data = src.read_bytes()
    layout, header = fields(src)
    work = Path(tempfile.mkdtemp(prefix="fuzz-gguf-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    mutant = work / "mutant.gguf"
    rng = random.Random(a.seed)
    commands = [c for c in a.commands.split(",") if c]
    cases: list[tuple[str, list[dict]]] = []
    if a.replay:
        cases += [(c["name"], c["mutations"]) for c in json.loads(Path(a.replay).read_text())]
    cases += [(f"seed {a.seed} #{i}", [mutation(rng, data, layout, header)]) for i in range(a.count)]
    counts: dict[str, int] = {}
    failures: list[dict] = []
    t0 = time.time()
    made = 0
    try:
        for i, (name, muts) in enumerate(cases):
            replayed = not name.startswith("seed ")
            if a.seconds and not replayed and time.time() - t0 > a.seconds:
                break
            blob = data
            for m in muts:
                blob = apply(blob, m)
            mutant.write_bytes(blob)
            made += 1
            for cmd in commands:
                if cmd == "serve" and i % 4 and not replayed:
                    continue
                argv, port = COMMANDS[cmd](mutant)
                res = run_forked(argv, a.timeout, port)
                counts[f"{cmd} {res['outcome']}"] = counts.get(f"{cmd} {res['outcome']}", 0) + 1
                if res["outcome"] not in ("answered", "refused"):
                    failures.append({"name": name, "command": cmd, "mutations": muts, **res})
                    print(f"FAIL {name} {cmd}: {res['outcome']} {json.dumps(muts)}", flush=True)
            if made % 20 == 0:
                print(f"{made} mutants, {time.time() - t0:.0f} s: {counts}", flush=True)
    finally:
        mutant.unlink(missing_ok=True)
        work.rmdir()
    result = {"model": src.name, "seed": a.seed, "mutants": made, "commands": commands,
              "seconds": round(time.time() - t0, 1), "counts": counts, "failures": failures, "ok": not failures}
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    if a.seeds and failures:
        Path(a.seeds).write_text(json.dumps([{"name": f"{f['name']} ({f['command']}: {f['outcome']})",
                                               "mutations": f["mutations"]} for f in failures], indent=1) + "\n")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
