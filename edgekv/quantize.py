"""Re-quantise a model's weights with llama.cpp's own quantiser (``llama_model_quantize``).

Why: llama.cpp's CPU kernels are not equally fast for every weight type. On
x86 its repacked GEMMs cover Q4_0, Q4_K and IQ4_NL, and the tiled GEMM covers
Q8_0 and F16; Q4_1 (the default SmolLM2 file) has neither, so its prefill runs
the generic dot products. Converting trades a little quality (Q4_1 -> Q4_0) or
memory (-> Q8_0, F16) for prefill speed; ``bench/RESULTS.md`` has both sides
measured. It is opt-in: ``edgekv models quantize MODEL --type q4_0`` writes a
new file next to edgekv's model cache and prints its path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import time
from pathlib import Path

from .errors import ModelError
from .models import models_dir, validate_gguf

# llama_ftype values (llama.h), the types worth converting to on a CPU
TYPES = {"q4_0": 2, "q8_0": 7, "f16": 1}


def quantized_path(src: Path, type_name: str) -> Path:
    """Where ``quantize`` writes ``src`` converted to ``type_name`` by default: keyed by the
    source's path, size and time, so another file of the same name never collides."""
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:8]
    return models_dir() / "quantized" / f"{src.stem}.{key}.{type_name}.gguf"


def quantize(src: str | os.PathLike[str], type_name: str, dest: Path | None = None,
             threads: int | None = None) -> tuple[Path, float]:
    """Convert ``src`` (any GGUF llama.cpp loads) to ``type_name`` weights into ``dest`` (default:
    edgekv's cache); returns the new file and the seconds it took (0 when the cache already
    holds this conversion; an explicit ``dest`` is always written). Tensors that
    llama.cpp keeps in higher precision (norms, some embeddings) stay as they are."""
    from .llama import last_log_error, lib

    if type_name not in TYPES:
        raise ModelError(f"unknown weight type {type_name!r}; choose one of {', '.join(TYPES)}")
    src = Path(src)
    validate_gguf(src)
    if dest is None:  # the cache: an earlier conversion of this very file is reused
        dest = quantized_path(src, type_name)
        if dest.exists():
            validate_gguf(dest)
            return dest, 0.0
    dest = Path(dest)
    if dest.resolve() == src.resolve():
        raise ModelError("the converted file would overwrite its source; pass another --out")
    dest.parent.mkdir(parents=True, exist_ok=True)
    L = lib()
    p = L.llama_model_quantize_default_params()
    p.ftype = TYPES[type_name]
    p.allow_requantize = True  # the source is usually quantised already
    p.nthread = threads or (os.cpu_count() or 1)
    part = dest.with_name(dest.name + ".part")
    t0 = time.perf_counter()
    rc = L.llama_model_quantize(str(src).encode(), str(part).encode(), ctypes.byref(p))
    if rc != 0 or not part.exists():
        part.unlink(missing_ok=True)
        raise ModelError(f"llama.cpp could not convert {src.name} to {type_name}: {last_log_error() or f'status {rc}'}")
    os.replace(part, dest)
    return dest, time.perf_counter() - t0
