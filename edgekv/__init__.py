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

import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"


def _load_cuda_libllama_first() -> None:
    """Load a CUDA build of libllama before numpy is imported.

    On an H200 machine (nvcc 13.0, GCC 13.3), such a build loaded *after* numpy (or any
    module that brings libstdc++ in first) segfaulted in the tokenizer's ``std::regex``
    while loading a model; loaded first, it worked (docs/backends.md, "GPUs"). CPU-only
    builds are left alone, so ``edgekv --help`` stays quick there."""
    if "numpy" in sys.modules:
        return  # too late to help; docs/backends.md tells embedders to import edgekv first
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    if any(lib.glob("libggml-cuda.*")):
        try:
            import llama_cpp.llama_cpp  # noqa: F401  (loads libllama and its backends)
        except Exception:
            pass  # a broken install: edgekv.llama.lib() reports it in one line when it is needed


_load_cuda_libllama_first()

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
