"""llama.cpp's RPC backend on loopback: the model and its KV cache on one rpc-server, or
split over two, against the same model in this process's memory.

A cache on an RPC server is not in host memory, so every native op takes its ggml graph,
scheduled on the server: the path a GPU runs, here on a backend that is really remote.
The servers are llama.cpp's own rpc-server (built by setup from the same vendored source)
on 127.0.0.1, started per module and never on any other address."""

from __future__ import annotations

import ctypes
import gc
import os
import re
import signal
import socket
import subprocess
import threading
import time

import numpy as np
import pytest
from _helpers import CMD, prefill, run_cli
from _helpers import random_keep as _keep

from edgekv import rpc
from edgekv.kvcache.native import NativeEngine
from edgekv.llama import Context, Model, buffer_sizes
from edgekv.rpc import RpcError

TEXT = ("The lighthouse keeper wrote down every ship that passed, its flag, its cargo and the hour. "
        "On stormy nights the entries grew short. ") * 8


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    # ggml's client aborts when a server it holds buffers on goes away, so the servers
    # outlive every model of this process: they end with it (PR_SET_PDEATHSIG)
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)


def _servers(n: int):
    procs = [rpc.start_server(rpc.free_port(), threads=1, preexec_fn=_die_with_parent) for _ in range(n)]
    eps = tuple(f"127.0.0.1:{p.args[4]}" for p in procs)
    yield eps
    gc.collect()
    if not any(rpc._in_use.get(ep) for ep in eps):  # nothing of this process left on them
        for p in procs:
            p.terminate()
            p.wait(10)


@pytest.fixture(scope="module")
def servers():
    """Two servers for this process's models."""
    yield from _servers(2)


@pytest.fixture(scope="module")
def cli_servers():
    """Two more for the CLI's processes: a server serves one client at a time."""
    yield from _servers(2)


@pytest.fixture(scope="module")
def remote(smollm2_path, servers):
    """The default model on one server, and on two (layers split)."""
    models = {1: Model(smollm2_path, rpc=servers[:1]), 2: Model(smollm2_path, rpc=servers)}
    yield models
    for m in models.values():
        m.close()


@pytest.fixture(scope="module")
def toks(smollm2) -> list[int]:
    return smollm2.tokenize(TEXT)


def _ctx(model: Model, fa: str) -> Context:
    return Context(model, n_ctx=512, cache_type_k="f16", cache_type_v="f16", flash_attn=fa, n_threads=2)


def test_the_server_speaks_this_clients_protocol(servers) -> None:
    # first in the module: a server serves one client at a time, and the models below hold it
    assert rpc.probe(servers[1])[:2] == (rpc.RPC_PROTO_MAJOR, rpc.RPC_PROTO_MINOR)


def test_the_model_and_its_cache_are_on_the_servers(smollm2, remote) -> None:
    # llama.cpp logs where each layer and buffer went: every layer on the servers (only the
    # token embeddings stay here), the two-server model's layers and cache split over both,
    # nothing of the cache in this process
    for n, m in remote.items():
        assert len(rpc.device_names(rpc.devices(m.rpc, m))) == n
        done = re.search(r"offloaded (\d+)/(\d+) layers", m.load_log)
        assert done and done.group(1) == done.group(2), m.load_log[-2000:]
        layer_devices = set(re.findall(r"layer +\d+ assigned to device (RPC\d+)", m.load_log))
        assert len(layer_devices) == n, layer_devices
        assert len([k for k in buffer_sizes(m.load_log, "model") if k.startswith("RPC")]) == n
        ctx = _ctx(m, "off")
        kv = buffer_sizes(ctx.creation_log, "KV")
        assert kv and all(k.startswith("RPC") for k in kv) and len(kv) == n, kv
        ctx.close()
    local = _ctx(smollm2, "off")
    assert not any(k.startswith("RPC") for k in buffer_sizes(local.creation_log, "KV"))
    local.close()


def _run(model: Model, toks: list[int], fa: str) -> dict[str, object]:
    """Prefill, a per-head compaction, a merge with the log-count bias, then reads, window
    scores and a greedy continuation: everything a session asks of the native engine."""
    ctx = _ctx(model, fa)
    eng = NativeEngine(ctx)
    L, H, d = model.arch.n_layer, model.arch.n_head_kv, model.arch.head_dim_k
    out: dict[str, object] = {}
    prefill(eng, toks)
    rng = np.random.default_rng(3)
    eng.compact(_keep(rng, L, H, eng.n_cells, eng.n_cells // 2))
    out["compacted"] = ctx.state_get()
    G, M = 5, 3
    members = np.stack([rng.choice(eng.n_cells, G * M, replace=False) for _ in range(L * H)]).reshape(L, H, G, M)
    eng._merge_groups(members, (rng.random((L, H, G, M)) + 0.1).astype(np.float32))
    out["merged"] = ctx.state_get()
    out["bias"] = eng.bias_get(cell_order=True)
    snap = eng.snapshot()
    out["keys"] = np.stack([snap.keys(li) for li in range(L)])
    out["values"] = np.stack([snap.values(li) for li in range(L)])
    q = np.random.default_rng(9).standard_normal((L, model.arch.n_head, 6, d)).astype(np.float32)
    q_pos = np.asarray(snap.pos[-6:], dtype=np.int32)
    out["scores"] = eng.score(q, q_pos, 1.0 / np.sqrt(d))  # a local cache: the host kernel
    before = os.environ.get("EDGEKV_GRAPH_OPS")
    os.environ["EDGEKV_GRAPH_OPS"] = "1"  # the graph, which the servers run
    try:
        out["scores_graph"] = eng.score(q, q_pos, 1.0 / np.sqrt(d))
    finally:  # as the run found it (a developer may run the suite with the switch on)
        if before is None:
            del os.environ["EDGEKV_GRAPH_OPS"]
        else:
            os.environ["EDGEKV_GRAPH_OPS"] = before
    out["norms"] = eng.key_sqnorms(cell_order=True)
    greedy = []
    tok = toks[-1]
    for _ in range(12):
        eng.decode([tok], ctx.pos_max() + 1)
        tok = int(np.argmax(ctx.logits()))
        greedy.append(tok)
    out["greedy"] = greedy
    out["logits"] = ctx.logits().copy()
    ctx.close()
    return out


@pytest.mark.parametrize("n_servers", [1, 2])
@pytest.mark.parametrize("fa", ["off", "on"])
def test_native_ops_on_the_servers_equal_the_local_cache(smollm2, remote, toks, n_servers, fa) -> None:
    local, far = _run(smollm2, toks, fa), _run(remote[n_servers], toks, fa)
    assert local["compacted"] != local["merged"]  # the merge changed the cache
    for key in ("compacted", "merged"):
        assert far[key] == local[key], f"{key}: the cache bytes differ"
    for key in ("bias", "keys", "values", "scores_graph", "norms"):
        np.testing.assert_array_equal(far[key], local[key], err_msg=key)
    # the servers' scores are the graph's; locally the host kernel rounds differently
    np.testing.assert_array_equal(far["scores"], far["scores_graph"])
    np.testing.assert_allclose(far["scores"], local["scores"], rtol=1e-5, atol=1e-6)
    assert far["greedy"] == local["greedy"]
    np.testing.assert_array_equal(far["logits"], local["logits"])


@pytest.mark.parametrize("method", ["knorm", "lagkv"])  # lagkv with --param L=32 (its window fits 128 cells)
def test_a_session_on_the_servers_generates_what_the_local_one_does(smollm2_path, cli_servers, method) -> None:
    # the whole user path, `edgekv generate --rpc` on two servers through a compressing method
    # (LagKV's scores are computed in host memory locally and from K/V read over RPC there)
    args = ["generate", smollm2_path, "--prompt", TEXT * 2, "--method", method, "--budget", "128",
            "--max-tokens", "16", "--threads", "2", *(["--param", "L=32"] if method == "lagkv" else [])]
    local = run_cli(*args)
    far = run_cli(*args, "--rpc", ",".join(cli_servers))
    assert local.returncode == 0, local.stderr
    assert far.returncode == 0, far.stderr
    assert far.stdout == local.stdout and local.stdout.strip()
    stats = re.search(r"\[cells .*compressions (\d+).*\]", far.stderr)
    assert stats and int(stats.group(1)) >= 1 and stats.group(0) in local.stderr, (far.stderr, local.stderr)


def _refusing_server() -> tuple[socket.socket, int]:
    """A TCP server that is not an RPC server: it answers anything with an HTTP error."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def serve() -> None:
        for _ in range(4):
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                c.recv(64)
                c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def test_bad_endpoints_are_one_line_errors() -> None:
    for bad in ("nohost", "host:", ":50052", "127.0.0.1:0", "127.0.0.1:99999", "127.0.0.1:5,127.0.0.1:5",
                "[::1]:50052", "127.0.0.1:x"):
        with pytest.raises(RpcError):
            rpc.parse_endpoints(bad)
    assert rpc.parse_endpoints("127.0.0.1:50052, localhost:7") == ("127.0.0.1:50052", "localhost:7")
    with pytest.raises(RpcError, match="cannot reach"):
        rpc.probe(f"127.0.0.1:{rpc.free_port()}")
    srv, port = _refusing_server()
    with pytest.raises(RpcError, match="not llama.cpp's rpc-server"):
        rpc.probe(f"127.0.0.1:{port}")
    srv.close()


def test_the_cli_refuses_unreachable_servers_in_one_line(smollm2_path) -> None:
    for value, why in (("127.0.0.1", "HOST:PORT"), (f"127.0.0.1:{rpc.free_port()}", "cannot reach")):
        r = run_cli("generate", smollm2_path, "--prompt", "hi", "--max-tokens", "2", "--rpc", value)
        assert r.returncode == 2
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("edgekv: error:") and why in lines[0], r.stderr


def test_edgekv_rpc_server_runs_llama_cpps_server() -> None:
    # `edgekv rpc-server` is llama.cpp's own binary (it execs it), answering this client's handshake
    port = rpc.free_port()
    proc = subprocess.Popen([*CMD, "rpc-server", "--port", str(port), "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                assert rpc.probe(f"127.0.0.1:{port}", timeout=1.0)[0] == rpc.RPC_PROTO_MAJOR
                break
            except RpcError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(10)
    r = run_cli("rpc-server", "--port", "70000")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--port" in r.stderr
