#!/usr/bin/env python3
"""The model and its KV cache on llama.cpp rpc-servers over loopback, against the same
session in this process's memory: prefill, one compression and decoding, interleaved.

    .venv/bin/edgekv bench run rpc --tokens 2048 --budget 1024 --decode 64 --rounds 3

Starts two rpc-servers (llama.cpp's own, built by setup) on 127.0.0.1 with ``--server-threads``
threads each. Each round runs four setups in turn: ``local`` (weights and cache here),
``local-graph`` (the same, with the native ops forced onto their ggml graphs,
``EDGEKV_GRAPH_OPS=1``: the path any cache outside host memory takes), ``rpc1``
(everything on one server) and ``rpc2`` (layers split over both). Each setup
feeds ``--tokens`` tokens of text through a ``--method`` session of ``--budget`` cells
(compressing whenever a chunk would not fit), times one more compression to
``--budget // 2`` cells and, right after it, one to ``--budget // 4`` (over RPC the first
graph of another shape after the prefill's costs far more than the op itself: the second
shows the op alone), then times ``--decode`` greedy tokens. Medians over the rounds
in ``bench/results/rpc.json``. On loopback the servers share this machine's cores, so the
numbers measure what the protocol costs, not what a second machine would add.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import statistics
import time


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no server outlives the benchmark


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="knorm")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="this process's threads (the local setup)")
    ap.add_argument("--server-threads", type=int, default=2)
    a = ap.parse_args()
    if a.tokens <= a.budget or a.budget < 64 or a.decode < 1 or a.rounds < 1:
        ap.error("need --tokens > --budget >= 64, --decode >= 1 and --rounds >= 1")

    import numpy as np

    from edgekv import rpc
    from edgekv.bench.results import machine, write_json
    from edgekv.bench.speed import long_text_tokens
    from edgekv.llama import Model, buffer_sizes
    from edgekv.models import resolve_model
    from edgekv.session import Session

    path = resolve_model(a.model)
    procs = [rpc.start_server(rpc.free_port(), threads=a.server_threads, preexec_fn=_die_with_parent)
             for _ in range(2)]
    eps = tuple(f"127.0.0.1:{p.args[4]}" for p in procs)
    local = Model(path)
    models = {"local": local, "local-graph": local, "rpc1": Model(path, rpc=eps[:1]), "rpc2": Model(path, rpc=eps)}
    toks = long_text_tokens(models["local"], a.tokens)
    times: dict[str, dict[str, list[float]]] = {k: {"prefill_s": [], "compress_ms": [], "compress_again_ms": [],
                                                        "decode_s": []} for k in models}
    greedy: dict[str, list[int]] = {}
    for r in range(a.rounds):
        for name, model in models.items():
            os.environ["EDGEKV_GRAPH_OPS"] = "1" if name == "local-graph" else "0"
            with Session(model, method=a.method, budget=a.budget, n_ctx=a.budget + 256, n_threads=a.threads) as s:
                t = time.perf_counter()
                s.feed(toks)
                times[name]["prefill_s"].append(time.perf_counter() - t)
                t = time.perf_counter()
                s.compress(a.budget // 2)
                times[name]["compress_ms"].append(1000 * (time.perf_counter() - t))
                t = time.perf_counter()
                s.compress(a.budget // 4)  # at once: the op graphs again, no decode graph in between
                times[name]["compress_again_ms"].append(1000 * (time.perf_counter() - t))
                out = []
                t = time.perf_counter()
                for _ in range(a.decode):
                    tok = int(np.argmax(s.logits()))
                    s.feed([tok])
                    out.append(tok)
                times[name]["decode_s"].append(time.perf_counter() - t)
                greedy.setdefault(name, out)
            print(f"round {r + 1}/{a.rounds} {name}: prefill {times[name]['prefill_s'][-1]:.2f} s, "
                  f"compression {times[name]['compress_ms'][-1]:.0f} ms, "
                  f"again {times[name]['compress_again_ms'][-1]:.0f} ms, "
                  f"decode {a.decode / times[name]['decode_s'][-1]:.1f} tok/s", flush=True)
    rows = []
    for name, ts in times.items():
        m = models[name]
        rows.append({
            "setup": name, "servers": len(m.rpc), "model": a.model, "method": a.method, "tokens": a.tokens,
            "budget": a.budget, "threads": a.threads, "server_threads": a.server_threads if m.rpc else None,
            "prefill_tok_s": round(a.tokens / statistics.median(ts["prefill_s"]), 1),
            "compress_ms": round(statistics.median(ts["compress_ms"]), 1),
            "compress_again_ms": round(statistics.median(ts["compress_again_ms"]), 1),
            "decode_tok_s": round(a.decode / statistics.median(ts["decode_s"]), 1),
            "same_greedy_as_local": greedy[name] == greedy["local"],
            "model_buffers_mib": {k: round(v, 1) for k, v in buffer_sizes(m.load_log, "model").items()},
            "rounds": a.rounds, "raw": ts,
        })
    os.environ.pop("EDGEKV_GRAPH_OPS", None)
    for m in models.values():
        m.close()
    for p in procs:
        p.terminate()
        p.wait(10)
    out = write_json("rpc", {"machine": machine(), "args": vars(a), "rows": rows})
    for row in rows:
        print(f"{row['setup']:5s}: prefill {row['prefill_tok_s']} tok/s, compression {row['compress_ms']} ms "
              f"(again {row['compress_again_ms']} ms), "
              f"decode {row['decode_tok_s']} tok/s, greedy as local: {row['same_greedy_as_local']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
