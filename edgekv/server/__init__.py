"""``edgekv serve``: an OpenAI-compatible local server whose conversations keep a fixed
KV budget. ``conversations`` recognises and stores them, ``turns`` runs them on one
worker thread, ``app`` is the HTTP side, ``page.html`` the web page at ``/``."""

from __future__ import annotations

from .app import App
from .conversations import ServerConfig, Settings

__all__ = ["App", "ServerConfig", "Settings", "serve"]


def serve(app: App, host: str = "127.0.0.1", port: int = 8080, *, log_level: str = "warning") -> None:
    """Run until interrupted (Ctrl-C); conversations' files are removed on the way out."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
