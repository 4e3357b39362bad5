"""llama.cpp's RPC backend: a model, its KV cache included, on other machines' ``rpc-server``s.

``edgekv chat|generate|serve --rpc HOST:PORT[,HOST:PORT]`` loads the model's layers onto
those servers (llama.cpp splits them by the servers' free memory) and keeps only the token
embeddings here. edgekv's native ops are ggml graphs scheduled on the backend that holds
the cache, so compaction, merging, reads and scores run on the servers unchanged; the
compaction's host shortcut (plain byte moves) only applies to a cache in this process's memory.

Three things this module adds around ggml's own client (``ggml_backend_rpc_add_server``):

- **A handshake before ggml connects.** ggml aborts the whole process when a server cannot
  be reached or speaks another protocol version; :func:`probe` makes the same HELLO
  exchange from Python first, so a wrong address is one line, not a crash.
- **Explicit devices.** The servers' devices go into the model's own device list
  (``llama_model_params.devices``) instead of ggml's global registry, so a model loaded
  without ``--rpc`` never asks a server for anything.
- **The server binary.** ``native/build_llama.py`` compiles llama.cpp's ``rpc-server``
  (``tools/rpc/rpc-server.cpp`` of the same vendored source) against the wheel's libggml,
  next to it; :func:`server_binary` finds it and ``edgekv rpc-server`` runs it.

A server that goes away while a model is loaded on it still ends this process (ggml's
client aborts on a failed send); llama.cpp's RPC backend has no reconnection.
"""

from __future__ import annotations

import ctypes
import importlib.util
import socket
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from functools import cache
from pathlib import Path

from .errors import EdgekvError

# ggml-rpc.h of the vendored llama.cpp: the protocol this client speaks
RPC_PROTO_MAJOR = 7
RPC_PROTO_MINOR = 0
_CMD_HELLO = 14  # fixed across protocol versions (static_assert in ggml-rpc.cpp)
_CAPS = 24  # RPC_CONN_CAPS_SIZE: transport capabilities; all zero asks for plain TCP
SERVER_NAME = "ggml-rpc-server"
DEFAULT_PORT = 50052  # rpc-server's own default


class RpcError(EdgekvError):
    """An RPC endpoint that is malformed, unreachable or speaks another protocol."""


def parse_endpoints(text: str) -> tuple[str, ...]:
    """``HOST:PORT[,HOST:PORT...]`` as a tuple of ``HOST:PORT`` strings, checked.

    The form is the one ggml parses (host, colon, decimal port), so every endpoint that
    passes here reaches ggml unchanged."""
    out: list[str] = []
    for item in (p.strip() for p in text.split(",")):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RpcError(f"--rpc takes HOST:PORT[,HOST:PORT...], got {item!r}")
        if ":" in host:
            raise RpcError(f"--rpc: {item!r}: ggml's RPC client takes IPv4 addresses and host names, not IPv6")
        ep = f"{host}:{int(port)}"
        if ep in out:
            raise RpcError(f"--rpc names {ep} twice")
        out.append(ep)
    if len(out) > 16:  # GGML_RPC_MAX_SERVERS
        raise RpcError(f"--rpc: at most 16 servers, got {len(out)}")
    return tuple(out)


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("closed")
        buf += part
    return buf


def probe(endpoint: str, timeout: float = 5.0) -> tuple[int, int, int]:
    """The server's protocol version, from the HELLO exchange ggml's client makes first.
    Raises ``RpcError`` for a server that cannot be reached, does not answer as an RPC
    server, or speaks a protocol this build cannot (ggml would abort on each)."""
    host, _, port = endpoint.rpartition(":")
    try:
        s = socket.create_connection((host, int(port)), timeout=timeout)
    except OSError as e:
        raise RpcError(f"cannot reach the RPC server {endpoint}: {e.strerror or e}") from e
    with s:
        try:
            s.sendall(struct.pack("<BQ", _CMD_HELLO, _CAPS) + bytes(_CAPS))
            (size,) = struct.unpack("<Q", _recv(s, 8))
            if size != 4 + _CAPS:
                raise RpcError(f"{endpoint} answered the RPC handshake with {size} bytes, not {4 + _CAPS}: "
                               "not llama.cpp's rpc-server, or another protocol")
            major, minor, patch = _recv(s, size)[:3]
        except TimeoutError as e:
            raise RpcError(f"the RPC server {endpoint} did not answer the handshake within {timeout:.0f} s "
                           "(an rpc-server serves one client at a time: is another process using it?)") from e
        except (OSError, ConnectionError) as e:
            raise RpcError(f"{endpoint} closed the RPC handshake: not llama.cpp's rpc-server, or another "
                           "protocol") from e
    if major != RPC_PROTO_MAJOR or minor > RPC_PROTO_MINOR:
        raise RpcError(f"the RPC server {endpoint} speaks protocol {major}.{minor}.{patch}; this build speaks "
                       f"{RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR}.x (run the rpc-server of the same llama.cpp)")
    return major, minor, patch


def lib_dir() -> Path:
    """llama-cpp-python's library folder: libllama, the libggml it loads, and the rpc-server."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise EdgekvError("llama-cpp-python is not installed: run scripts/setup.sh")
    return Path(spec.origin).parent / "lib"


@cache
def _ggml() -> ctypes.CDLL:
    from .llama import lib

    lib()  # libllama first: it loads this libggml and initialises the backends
    name = {"darwin": "libggml.dylib", "win32": "ggml.dll"}.get(sys.platform, "libggml.so")
    g = ctypes.CDLL(str(lib_dir() / name))
    g.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    g.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    g.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    g.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    g.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    g.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    g.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    g.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    g.ggml_backend_dev_name.restype = ctypes.c_char_p
    g.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    return g


_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)


@cache
def _add_server(endpoint: str) -> tuple[int, ...]:
    """ggml's RPC devices for one server, made once per process (ggml keeps them too)."""
    g = _ggml()
    reg = g.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise RpcError("this libllama was built without llama.cpp's RPC backend (GGML_RPC); run scripts/setup.sh")
    fn = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
    if not fn:
        raise RpcError("this libllama's RPC backend has no ggml_backend_rpc_add_server")
    server = _ADD_SERVER(fn)(endpoint.encode())
    if not server:
        raise RpcError(f"the RPC server {endpoint} offers no devices")
    return tuple(g.ggml_backend_reg_dev_get(server, i) for i in range(g.ggml_backend_reg_dev_count(server)))


_in_use: dict[str, weakref.WeakSet] = {}  # endpoint -> the open models holding a connection to it


def devices(endpoints: tuple[str, ...], user: object) -> list[int]:
    """The ggml devices of these servers, in order, for ``user`` (the model about to load).

    Each server is checked by :func:`probe` first, unless a model of this process already
    holds its one connection (an rpc-server serves one client at a time, so a second
    connection would wait for the first to close)."""
    out: list[int] = []
    for ep in endpoints:
        users = _in_use.setdefault(ep, weakref.WeakSet())
        if not users:
            probe(ep)
        out.extend(_add_server(ep))
    for ep in endpoints:
        _in_use[ep].add(user)
    return out


def release(endpoints: tuple[str, ...], user: object) -> None:
    """``user`` closed its connection to these servers (its buffers are freed)."""
    for ep in endpoints:
        _in_use.get(ep, weakref.WeakSet()).discard(user)


def device_names(devs: list[int]) -> list[str]:
    return [_ggml().ggml_backend_dev_name(d).decode() for d in devs]


def server_binary() -> Path:
    """llama.cpp's rpc-server built beside this libggml (``native/build_llama.py``)."""
    path = lib_dir() / SERVER_NAME
    if not path.is_file():
        raise RpcError(f"{path} is missing: run scripts/setup.sh (it builds llama.cpp's rpc-server)")
    return path


def start_server(port: int, *, host: str = "127.0.0.1", threads: int = 1, wait: float = 30.0,
                 **popen: object) -> subprocess.Popen:
    """Start an rpc-server and wait until it answers the handshake (tests and benchmarks
    run them on loopback). The caller stops it; ``popen`` goes to ``subprocess.Popen``."""
    # stderr to a file, not a pipe: nobody drains a pipe while the server runs, and a full
    # one would block the server's logging, and so the server
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([str(server_binary()), "-H", host, "-p", str(port), "-t", str(threads)],
                                stdout=subprocess.DEVNULL, stderr=err, **popen)
        deadline = time.monotonic() + wait
        while True:
            try:
                probe(f"{host}:{port}", timeout=1.0)
                return proc
            except RpcError:
                if proc.poll() is not None:
                    err.seek(0)
                    lines = err.read().decode(errors="replace").strip().splitlines()
                    raise RpcError(f"rpc-server on {host}:{port} exited: "
                                   f"{lines[-1] if lines else proc.returncode}") from None
                if time.monotonic() > deadline:
                    proc.kill()
                    raise RpcError(f"rpc-server on {host}:{port} did not answer within {wait:.0f} s") from None
                time.sleep(0.1)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = ["DEFAULT_PORT", "RpcError", "device_names", "devices", "free_port", "parse_endpoints", "probe",
           "release", "server_binary", "start_server"]
