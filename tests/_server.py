"""A real edgekv server on 127.0.0.1 for the tests: uvicorn in a thread of the test process,
so a test can drive it over HTTP and also look at the engines behind it."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from edgekv.config import ContextOptions
from edgekv.server import App, ServerConfig, Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(model, state_dir: Path, **kw) -> ServerConfig:
    """Small contexts so that conversations outgrow them within a test."""
    defaults = kw.pop("defaults", Settings("knorm", 160))
    opts = {"n_threads": kw.pop("threads", 2), "chunk": kw.pop("chunk", 64)}
    opts.update({k: kw.pop(k) for k in ("engine", "cache_type_k", "cache_type_v", "flash_attn") if k in kw})
    kw.setdefault("n_ctx", 256)
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 32)
    kw.setdefault("model_id", "smollm2-135m")
    return ServerConfig(model=model, defaults=defaults, state_dir=state_dir, options=ContextOptions(**opts), **kw)


@contextmanager
def running(app: App):
    """Serve ``app`` until the block ends; yields the base URL of its OpenAI API."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        app.close()


def engine_view(app: App) -> dict[str, int]:
    """Cells per live conversation, read from the engines themselves (not the stats)."""
    return {c.id: c.session.engine.n_cells for c in app.store.convs.values() if c.session is not None}
