"""Session files: a saved sequence (``CacheState``) plus a JSON header, on disk.

Like mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache``: module functions
beside the cache state. The header says what the cells were made with (model,
cache types, positions); the caller checks it against the live session before
anything touches the cache. Layout::

    b"EDGEKV\\x00\\x01"  u32 header length  header (JSON)
    token map  int32 little-endian, header["token_pos_shape"]
    llama.cpp's sequence blob, header["blob_len"] bytes
    log-count bias  float32 little-endian, header["bias_shape"] (merged cells only)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import EdgekvError
from .engine import CacheState

MAGIC = b"EDGEKV\x00\x01"
VERSION = 1


def save_cache_file(path: str | Path, state: CacheState, header: dict) -> None:
    """Write atomically (a ``.part`` file renamed into place)."""
    header = {**header, "version": VERSION, "token_pos_shape": list(state.token_pos.shape),
              "blob_len": len(state.blob),
              "bias_shape": list(state.bias.shape) if state.bias is not None else None}
    hb = json.dumps(header).encode()
    tmp = Path(str(path) + ".part")
    with open(tmp, "wb") as f:
        f.write(MAGIC + len(hb).to_bytes(4, "little") + hb)
        f.write(state.token_pos.astype("<i4").tobytes())
        f.write(state.blob)
        if state.bias is not None:
            f.write(state.bias.astype("<f4").tobytes())
    tmp.replace(path)


def load_cache_file(path: str | Path, engine: str) -> tuple[CacheState, dict]:
    """(state, header) of a session file; every format check happens here, before
    anything is handed to llama.cpp."""
    path = Path(path)
    if not path.is_file():
        raise EdgekvError(f"session file {path} does not exist")
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise EdgekvError(f"{path} is not an edgekv session file")
    try:
        hl = int.from_bytes(data[8:12], "little")
        header = json.loads(data[12 : 12 + hl])
    except (ValueError, UnicodeDecodeError) as e:
        raise EdgekvError(f"{path}: session header is corrupt or truncated ({e})") from e
    if header.get("version") != VERSION:
        raise EdgekvError(f"{path}: session file version {header.get('version')} is not supported")
    shape = tuple(header["token_pos_shape"])
    off = 12 + hl
    n_tp = int(np.prod(shape)) * 4
    bias_shape = header.get("bias_shape")
    n_bias = int(np.prod(bias_shape)) * 4 if bias_shape else 0
    if len(data) != off + n_tp + header["blob_len"] + n_bias:
        raise EdgekvError(f"{path}: session file is truncated or has extra bytes")
    token_pos = np.frombuffer(data[off : off + n_tp], dtype="<i4").reshape(shape).astype(np.int32)
    end = off + n_tp + header["blob_len"]
    bias = np.frombuffer(data[end:], dtype="<f4").reshape(bias_shape).astype(np.float32) if bias_shape else None
    return CacheState(blob=data[off + n_tp : end], token_pos=token_pos, engine=engine, bias=bias), header
