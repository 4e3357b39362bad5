"""edgekv: long-context LLM inference on small machines.

Embedding API::

    from edgekv import Session, Chat
    with Session("model.gguf", method="knorm", budget=1024) as s:
        chat = Chat(s)
        for piece in chat.send("Summarise this: ..."):
            print(piece, end="")
        print(s.stats)

Imports are lazy so ``edgekv --help`` does not load libllama.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Chat", "EdgekvError", "SamplerConfig", "Session", "get_method", "METHODS"]


def __getattr__(name: str):
    if name in ("Chat", "SamplerConfig", "Session"):
        from . import session

        return getattr(session, name)
    if name in ("get_method", "METHODS"):
        from . import methods

        return getattr(methods, name)
    if name == "EdgekvError":
        from .errors import EdgekvError

        return EdgekvError
    raise AttributeError(name)
