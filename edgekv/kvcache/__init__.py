"""KV engines: the verbs edgekv needs from a llama.cpp KV cache (``engine.py``),
the portable implementation (``state.py``) and the native one (``native.py``),
and the choice between them."""

from __future__ import annotations

import ctypes

from ..errors import EdgekvError
from ..llama import Context, lib
from .engine import CacheState, KVEngine
from .snapshot import KVSnapshot
from .state import StateEngine

ENGINES = ("auto", "native", "state")


def native_available() -> bool:
    """True when the loaded libllama carries edgekv's patch set."""
    lib()
    import llama_cpp.llama_cpp as L

    return hasattr(L._lib, "llama_edgekv_api_version")


def make_engine(ctx: Context, kind: str = "auto") -> KVEngine:
    """``auto``: the native ops when the loaded libllama has them and they handle this
    cache, the portable state engine otherwise."""
    from .native import NativeEngine, NativeUnsupported

    if kind == "state":
        return StateEngine(ctx)
    if kind in ("auto", "native"):
        try:
            return NativeEngine(ctx)
        except NativeUnsupported:
            if kind == "native":
                raise
            return StateEngine(ctx)
    raise EdgekvError(f"unknown engine {kind!r}; use auto, state or native")


def engine_summary() -> str:
    """One line for ``edgekv info``: which engine sessions get, and why."""
    lib()
    import llama_cpp.llama_cpp as L

    from .native import NATIVE_API, api_version

    if native_available():
        fn = L._lib.llama_edgekv_api_version
        fn.restype = ctypes.c_int32
        v = fn()
        if v < NATIVE_API:
            return (f"engine: state (portable); libllama carries edgekv patch set v{v}, older than the v{NATIVE_API} "
                    "this edgekv needs (rerun scripts/setup.sh)")
        if api_version():
            return (f"engine: native (libllama carries edgekv patch set v{v}; compaction, merge with "
                    "log-count bias, read, key norms and score run where the cache lives; iSWA caches use the state engine)")
        return (f"engine: state (portable); libllama carries edgekv patch set v{v} but the cffi bindings "
                "are not built (run native/build_native.py)")
    return "engine: state (portable; stock libllama without edgekv's patch set)"


__all__ = ["ENGINES", "CacheState", "KVEngine", "KVSnapshot", "StateEngine", "engine_summary", "make_engine",
           "native_available"]
