"""``edgekv serve``: an OpenAI-compatible local server whose conversations keep a fixed
KV budget. ``conversations`` recognises and stores them, ``turns`` runs them on one
worker thread, ``app`` is the HTTP side, ``page.html`` the web page at ``/``."""

from __future__ import annotations

from .app import App
from .conversations import ServerConfig, Settings

__all__ = ["App", "ServerConfig", "Settings", "serve"]


def fixed_mmap_threshold(size: int = 256 << 10) -> bool:
    """Keep glibc from retaining freed large buffers, for a long-running server.

    glibc raises its mmap threshold to the size of each large block freed, so after the
    first session file (MiBs) is loaded and freed, later ones come from the heap and stay
    resident: over bench/server_load.py (16 conversations, about 90 saves and 80 resumes) the
    server's RSS grew 9 % with the default and 0.6 to 1.3 % with the threshold fixed at 256 KiB
    (the same effect as MALLOC_MMAP_THRESHOLD_). False where there is no glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return bool(libc and libc.mallopt(-3, size))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def serve(app: App, host: str = "127.0.0.1", port: int = 8080, *, log_level: str = "warning") -> None:
    """Run until interrupted (Ctrl-C); conversations' files are removed on the way out."""
    import uvicorn

    fixed_mmap_threshold()
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
