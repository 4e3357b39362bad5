#!/usr/bin/env python3
"""A bounded load test of ``edgekv serve`` on loopback: N concurrent conversations, a fixed
number of turns each, driven by OpenAI's Python client; it stops by itself.

The server runs as its own process (``edgekv serve``), so its resident memory is read
from /proc while the clients talk: after the warm-up (every conversation has had its
first turn, so every context size and code path has been allocated once) and at the
end. With more conversations than ``--max-live`` contexts, the least recently used
idle conversations go to disk and come back, every turn.

As a soak (``--disconnect``, ``--bad``), clients also walk away mid-reply (the server
drops that turn's conversation; the client's next turn starts it over from its
messages) and send malformed requests between turns (each must be a one-line 4xx).
Memory must then be flat over the turns (``edgekv.bench.drift``: RSS and the server's
Python heap, from its stats endpoint).

With ``--clients K`` the load is stationary: K clients each hold one conversation at a
time and start the next when theirs ends, so the mix of conversation lengths stops
changing after the first round; with ``--max-conversations`` the server forgets the
oldest idle ones, as a long-running server does. Without it, every conversation starts
at once and all of them lengthen together until the last turn.

    .venv/bin/edgekv bench run server_load --conversations 16 --turns 6
    .venv/bin/python bench/server_load.py --conversations 64 --turns 20 --disconnect 0.05 --bad 0.1 \
        --out server_soak
    .venv/bin/python bench/server_load.py --conversations 64 --turns 20 --clients 8 --max-conversations 16 \
        --disconnect 0.05 --bad 0.1 --out server_soak_stationary
write bench/results/<out>.json (and, for a soak, a plot beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

TOPICS = ["the sea", "mountains", "rivers", "forests", "deserts", "cities", "islands", "volcanoes", "glaciers",
          "caves", "lakes", "prairies", "jungles", "canyons", "reefs", "marshes"]
DRAIN_S = 30.0  # how long an abandoned last reply may take to wind down before the server counts as stuck


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(base: str, path: str) -> dict:
    with urllib.request.urlopen(base + path, timeout=30) as r:
        return json.load(r)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--method", default="knorm")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--n-ctx", type=int, default=384)
    ap.add_argument("--max-live", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clients", type=int, default=0,
                    help="clients that each run conversations one after another (0: one per conversation, all at once)")
    ap.add_argument("--max-conversations", type=int, default=None, help="passed to the server")
    ap.add_argument("--out", default="server_load", help="result name under bench/results")
    ap.add_argument("--json", default=None, help="write the result here instead (tests)")
    ap.add_argument("--disconnect", type=float, default=0.0, help="share of turns a client abandons mid-reply")
    ap.add_argument("--bad", type=float, default=0.0, help="share of turns preceded by a malformed request")
    ap.add_argument("--seed", type=int, default=0, help="of the disconnects and malformed requests")
    a = ap.parse_args()

    import openai

    from edgekv.bench.drift import Drift
    from edgekv.bench.speed import proc_status

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "edgekv.cli", "serve", a.model, "--method", a.method, "--budget", str(a.budget),
           "--n-ctx", str(a.n_ctx), "--max-live", str(a.max_live), "--port", str(port), "--temperature", "0",
           *(["--threads", str(a.threads)] if a.threads else []),
           *(["--max-conversations", str(a.max_conversations)] if a.max_conversations else [])]
    # traced, so the stats endpoint can report the server's Python heap (a few % slower)
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONTRACEMALLOC": "1"})
    server_err: list[str] = []  # drained all along, so a chatty server never blocks on a full pipe
    threading.Thread(target=lambda: server_err.extend(server.stderr), daemon=True).start()
    deadline = time.time() + 120
    while True:
        try:
            model_id = get(base, "/v1/models")["data"][0]["id"]
            break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                time.sleep(0.5)
                print("".join(server_err), file=sys.stderr)
                raise SystemExit("the server did not start") from None
            time.sleep(0.2)

    rss: list[tuple[float, float]] = []
    stop_sampling = threading.Event()
    t0 = time.perf_counter()

    def sample() -> None:
        while not stop_sampling.is_set():
            rss.append((time.perf_counter() - t0, proc_status("VmRSS", server.pid)))
            stop_sampling.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    n, turns = a.conversations, a.turns
    clients = a.clients or n
    if not 1 <= clients <= n:
        raise SystemExit("--clients must be 1..--conversations")
    warm = threading.Barrier(clients + 1)
    done_turns = 0
    lock = threading.Lock()
    rows: list[dict] = []
    errors: list[str] = []
    drift = Drift(unit="turn")
    walked_away: dict[int, int] = {}  # conversation -> its last turn, when the client left it mid-reply
    bad_sent, abandoned = [0], [0]

    def sample(done: int) -> None:
        st = get(base, "/v1/edgekv/stats")
        drift.add(done, st["totals"]["cells"], heap_mib=st["process"]["python_heap_mib"],
                  rss_mib=proc_status("VmRSS", server.pid) - st["process"]["tracemalloc_mib"])

    def malformed(rng: random.Random) -> None:
        """One request the server must refuse with a one-line 4xx, and lose nothing by."""
        body = rng.choice([b"{not json", b"[]", json.dumps({"model": model_id}).encode(),
                           json.dumps({"model": model_id, "messages": "hi"}).encode(),
                           json.dumps({"model": model_id, "messages": [{"role": "user", "content": "x"}],
                                       "method": "nosuch"}).encode(),
                           json.dumps({"model": model_id, "messages": [{"role": "user", "content": "x"}],
                                       "budget": -4}).encode(),
                           json.dumps({"model": model_id, "messages": [{"role": "user", "content": "x"}],
                                       "method_params": {"sinks": -3}}).encode()])
        req = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        bad_sent[0] += 1
        try:
            urllib.request.urlopen(req, timeout=60)
            errors.append(f"malformed request {body[:60]!r} was answered")
        except urllib.error.HTTPError as e:
            msg = json.load(e).get("error", {}).get("message", "")
            if not 400 <= e.code < 500 or not msg or "\n" in msg:
                errors.append(f"malformed request {body[:60]!r}: {e.code} {msg!r}")

    def client(k: int) -> None:
        """Conversations k, k + clients, ... one after another; the warm-up waits for every
        client's first turn."""
        for j, i in enumerate(range(k, n, clients)):
            talk(i, opening=j == 0)

    def talk(i: int, opening: bool) -> None:
        nonlocal done_turns
        rng = random.Random(a.seed * 1000 + i)
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
        topic = TOPICS[i % len(TOPICS)]
        msgs = [{"role": "system", "content": f"You are conversation {i}. Answer in a few sentences."}]
        for t in range(turns):
            if t == 1 and opening:
                warm.wait()  # every client has finished its first turn
            if rng.random() < a.bad:
                malformed(rng)
            leave = t > 0 and rng.random() < a.disconnect
            msgs.append({"role": "user", "content": f"Tell me something new about {topic} (part {t + 1})."})
            start = time.perf_counter()
            first = None
            pieces: list[str] = []
            ek = usage = None
            try:
                stream = c.chat.completions.create(model=model_id, messages=msgs, max_tokens=a.max_tokens,
                                                   stream=True, stream_options={"include_usage": True})
                for ch in stream:
                    if ch.choices and ch.choices[0].delta.content:
                        first = first or time.perf_counter()
                        pieces.append(ch.choices[0].delta.content)
                        if leave:
                            stream.close()  # the client walks away mid-reply
                            break
                    if ch.model_extra.get("edgekv"):
                        ek = ch.model_extra["edgekv"]
                    if ch.usage:
                        usage = ch.usage
            except Exception as e:  # counted, and the conversation goes on
                errors.append(f"conversation {i} turn {t + 1}: {e}")
                continue
            if leave:
                msgs.pop()  # its next turn asks something else, over the messages the server had
                with lock:
                    walked_away[i] = t + 1
                    abandoned[0] += 1
                continue
            end = time.perf_counter()
            msgs.append({"role": "assistant", "content": "".join(pieces)})
            with lock:
                rows.append({"conversation": i, "turn": t + 1, "seconds": end - start,
                             "first_token_s": (first or end) - start, "answered": bool(pieces),
                             "completion_tokens": usage.completion_tokens if usage else 0,
                             "prompt_tokens": usage.prompt_tokens if usage else 0,
                             "cached_tokens": usage.prompt_tokens_details.cached_tokens if usage else 0,
                             "continued": bool(ek and ek["continued"]), "cells": ek["cells"] if ek else None})
                done_turns += 1
                if done_turns % 4 == 0 or done_turns == n:
                    sample(done_turns)
                print(f"[{done_turns}/{n * turns}] conversation {i} turn {t + 1}: {end - start:.1f} s, "
                      f"{usage.completion_tokens if usage else 0} tokens", file=sys.stderr, flush=True)
        if turns == 1 and opening:
            warm.wait()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    warm.wait()
    warm_at, warm_rss = time.perf_counter() - t0, proc_status("VmRSS", server.pid)
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    end_rss = proc_status("VmRSS", server.pid)
    stop_sampling.set()
    sampler.join()
    # A reply a client walked away from at its last turn may still be winding down
    # (the server notices at its next write); give it a bounded time to drain.
    drain_start = time.perf_counter()
    while True:
        stats = get(base, "/v1/edgekv/stats")
        idle = stats["totals"]["active_requests"] == 0 and not any(
            c["state"] == "busy" for c in stats["conversations"])
        if idle or time.perf_counter() - drain_start > DRAIN_S:
            break
        time.sleep(0.2)
    drain_s = time.perf_counter() - drain_start
    server.send_signal(signal.SIGINT)
    try:
        code = server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        code = -9

    answered = sum(r["answered"] for r in rows)
    left = sum(1 for t in walked_away.values() if t == turns)  # conversations dropped at their last turn
    out_tokens = sum(r["completion_tokens"] for r in rows)
    later = [r for r in rows if r["turn"] > 1]
    totals = stats["totals"]
    cap = a.max_conversations or n  # a server remembers at most this many
    result = {
        "machine": __import__("edgekv.bench.results", fromlist=["machine"]).machine(),
        "command": " ".join(["bench/server_load.py", *sys.argv[1:]]),
        "config": {"model": model_id, "conversations": n, "turns": turns, "max_tokens": a.max_tokens,
                   "clients": clients, "max_conversations": a.max_conversations, "method": a.method, "budget": a.budget, "n_ctx": a.n_ctx, "max_live": a.max_live},
        "requests": n * turns, "answered": answered, "errors": errors,
        "walked_away": abandoned[0], "malformed_requests": bad_sent[0],
        "drift": drift.verdict(), "drift_series": drift.series(),
        "wall_s": round(wall, 2), "drain_s": round(drain_s, 2), "completion_tokens": out_tokens,
        "completion_tok_s": round(out_tokens / wall, 2),
        "turn_s_median": round(statistics.median(r["seconds"] for r in rows), 2) if rows else None,
        "first_token_s_median": round(statistics.median(r["first_token_s"] for r in rows), 2) if rows else None,
        "continued_fraction": round(sum(r["continued"] for r in later) / len(later), 3) if later else None,
        "rss_mib": {"warm": round(warm_rss, 1), "warm_at_s": round(warm_at, 1), "end": round(end_rss, 1),
                    "peak": round(max(v for _, v in rss), 1), "change_pct": round(100 * (end_rss / warm_rss - 1), 2),
                    "series": [[round(t, 1), round(v, 1)] for t, v in rss]},
        "server": {"conversations": totals["conversations"], "live": totals["live"], "saved": totals["saved"],
                   "saves": totals["saves"], "resumes": totals["resumes"], "active_requests": totals["active_requests"],
                   "created": totals["created"], "abandoned": totals["abandoned"], "forgotten": totals["forgotten"],
                   "busy": sum(c["state"] == "busy" for c in stats["conversations"]),
                   "max_cells": max((c["cells"] for c in stats["conversations"]), default=0),
                   "exit_code": code},
    }
    drift_rss = result["drift"]["rss_mib"]  # from the end of the warm-up the drift verdict judges
    checks = {
        "every turn answered": answered == n * turns - abandoned[0] and not errors,
        "RSS within 5 % after the warm-up": (abs(drift_rss["end"] / drift_rss["warm"] - 1) <= 0.05
                                             if drift_rss["warm"] > 0 else abs(result["rss_mib"]["change_pct"]) <= 5.0),
        # without a cap, every conversation is there but those a client left at its last turn;
        # with one, the oldest idle ones go (a walk-away's drop may land after a newer
        # conversation pushed one out), so the server's own counts must add up instead
        "every conversation kept": (n - left <= totals["conversations"] <= n if cap >= n
                                    else totals["conversations"] <= cap),
        "every conversation accounted for": (totals["conversations"] == totals["created"] - totals["abandoned"]
                                             - totals["forgotten"] and totals["abandoned"] <= abandoned[0]
                                             and (totals["forgotten"] == 0) == (totals["created"] <= cap)),
        "memory flat over the turns": result["drift"]["flat"] is not False,
        f"no request still active {DRAIN_S:.0f} s after the clients": totals["active_requests"] == 0,
        f"no conversation still busy {DRAIN_S:.0f} s after the clients": result["server"]["busy"] == 0,
        "live within --max-live": totals["live"] <= a.max_live,
        "cells within --n-ctx": result["server"]["max_cells"] <= a.n_ctx,
        "server exited cleanly": code == 0,
    }
    failed = [name for name, passed in checks.items() if not passed]
    ok = not failed
    result["ok"], result["failed_checks"] = ok, failed
    if failed:
        print("failed: " + "; ".join(failed), file=sys.stderr)
        if errors:
            print("errors: " + "; ".join(errors[:5]), file=sys.stderr)
        print("server stderr (tail):\n" + "".join(server_err)[-3000:], file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    else:
        from edgekv.bench.results import write_json

        path = write_json(a.out, result)
        if a.disconnect or a.bad:
            load = f"{clients} clients, " if a.clients else ""
            drift.plot(path.with_suffix(".png"), f"server soak: {n} conversations x {turns} turns, {load}--max-live "
                                                 f"{a.max_live}, {a.method} budget {a.budget}")
        print(path, file=sys.stderr)
    d = result["drift"]
    print(f"memory over the turns: RSS {d['rss_mib']['slope_pct_of_warm_rss_per_1000']} %, Python heap "
          f"{d['heap_mib']['slope_pct_of_warm_rss_per_1000']} % of the warm RSS per 1000 turns ({d['why']}); "
          f"{abandoned[0]} replies "
          f"abandoned, {bad_sent[0]} malformed requests refused", file=sys.stderr)
    print(f"{answered}/{n * turns} answered in {wall:.0f} s ({out_tokens / wall:.1f} tok/s out), turn median "
          f"{result['turn_s_median']} s, first token {result['first_token_s_median']} s; RSS {warm_rss:.0f} MiB "
          f"after warm-up, {end_rss:.0f} MiB at the end ({result['rss_mib']['change_pct']:+.1f} %); "
          f"{totals['saves']} saves, {totals['resumes']} resumes; {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
