"""Session files: a saved sequence (``CacheState``) plus a JSON header, on disk.

Like mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache``: module functions
beside the cache state. The header says what the cells were made with (model,
cache types, positions); the caller checks it against the live session before
anything touches the cache. Layout (version 4)::

    b"EDGEKV\\x00\\x01"  u32 header length  header (JSON)
    token map  int32 little-endian, header["token_pos_shape"]
    llama.cpp's sequence blob, header["blob_len"] bytes
    then each array of header["arrays"] in order, little-endian, as
    {"name", "dtype" ("f4"/"i4"/"f8"), "shape"}: "counts" (how many tokens each merged
    cell stands for; header["bias"] says whether attention adds their log),
    "window_q" and "window_pos" (the observation window; its size and layers in
    header["window"]), "tally" (H2O's accumulated attention), "rot" (where each
    key is rotated, once a context shift or renumbering moved it; header["pos_shift"]
    maps the llama.cpp positions of later cells to token positions), "ids" (the token
    id at each token position, -1 unknown: the text the cells stand for),
    "moments_total" and "moments_outer" (float64 sums of the pre-RoPE queries and of their
    outer products; the count, the skipped first positions and the layers in
    header["moments"]: Expected Attention's statistics)
    SHA-256 of every byte above (32 bytes)

The digest is checked before anything else is read: a bit flip or splice inside
the K/V payload would otherwise load as a silently different cache. Version 3
files (the same without the digest), version 2 files (a "bias" array: the log of the counts, applied in attention)
and version 1 files (that bias only, as header["bias_shape"]) still load.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ..errors import EdgekvError
from .engine import CacheState
from .queries import QueryMoments, QueryWindow

MAGIC = b"EDGEKV\x00\x01"
VERSION = 4
DIGEST = 32  # bytes of the SHA-256 trailer
ITEM_SIZE = {"f4": 4, "i4": 4, "f8": 8}  # the array types a session file holds


def _arrays(state: CacheState) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    if state.counts is not None:
        out["counts"] = state.counts.astype("<f4")
    if state.window is not None:
        out["window_q"] = state.window.q.astype("<f4")
        out["window_pos"] = state.window.pos.astype("<i4")
    if state.tally is not None:
        out["tally"] = state.tally.astype("<f4")
    if state.moments is not None:  # sums: float64, so a resumed session predicts as the live one
        out["moments_total"] = state.moments.total.astype("<f8")
        out["moments_outer"] = state.moments.outer.astype("<f8")
    if state.rot is not None:
        out["rot"] = state.rot.astype("<i4")
    if state.ids is not None and state.ids.size:
        out["ids"] = state.ids.astype("<i4")
    return out


def save_cache_file(path: str | Path, state: CacheState, header: dict) -> None:
    """Write atomically (a ``.part`` file renamed into place)."""
    arrays = _arrays(state)
    header = {**header, "version": VERSION, "token_pos_shape": list(state.token_pos.shape),
              "blob_len": len(state.blob), "bias": bool(state.bias), "pos_shift": int(state.pos_shift),
              "arrays": [{"name": k, "dtype": a.dtype.str[1:], "shape": list(a.shape)} for k, a in arrays.items()]}
    if state.window is not None:
        header["window"] = {"size": state.window.size, "layers": list(state.window.layers)}
    if state.moments is not None:
        header["moments"] = {"count": state.moments.count, "skip": state.moments.skip,
                             "layers": list(state.moments.layers)}
    hb = json.dumps(header).encode()
    parts = [MAGIC + len(hb).to_bytes(4, "little") + hb, state.token_pos.astype("<i4").tobytes(), state.blob,
             *(a.tobytes() for a in arrays.values())]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    write_atomic(path, [*parts, digest.digest()])


def write_atomic(path: str | Path, parts: list[bytes]) -> None:
    """Write ``parts`` to ``path`` so that a crash at any moment leaves either the old file
    or the whole new one: a ``.part`` file, fsynced, renamed into place, the directory fsynced
    (without that last step the rename itself may not survive a power loss)."""
    path = Path(path)
    tmp = Path(str(path) + ".part")
    with open(tmp, "wb") as f:
        for part in parts:
            f.write(part)
        f.flush()
        os.fsync(f.fileno())  # the rename must not land before the bytes do
    tmp.replace(path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: str | Path) -> str | None:
    """The SHA-256 a session file ends with, as hex (None for a file too short to have one):
    what names one exact file, read without reading the file. ``load_cache_file`` checks it."""
    try:
        with open(path, "rb") as f:
            if f.seek(0, os.SEEK_END) < len(MAGIC) + 4 + DIGEST:
                return None
            f.seek(-DIGEST, os.SEEK_END)
            return f.read(DIGEST).hex()
    except OSError:
        return None


def load_cache_file(path: str | Path, engine: str) -> tuple[CacheState, dict]:
    """(state, header) of a session file; every format check happens here, before
    anything is handed to llama.cpp."""
    path = Path(path)
    if not path.is_file():
        raise EdgekvError(f"session file {path} does not exist")
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise EdgekvError(f"{path} is not an edgekv session file")
    if len(data) > DIGEST + 12 and hashlib.sha256(memoryview(data)[:-DIGEST]).digest() == data[-DIGEST:]:
        data = data[:-DIGEST]
        checked = True
    else:
        checked = False  # a version 3 (or older) file, or a corrupted one: the header says which
    try:
        hl = int.from_bytes(data[8:12], "little")
        header = json.loads(data[12 : 12 + hl])
        if not isinstance(header, dict):
            raise ValueError("the header is not an object")
        version = header.get("version")
        if version == VERSION and not checked:
            raise EdgekvError(f"{path}: session file is corrupted (checksum mismatch)")
        if version == 1:  # the bias was the only array
            bs = header.get("bias_shape")
            specs = [{"name": "bias", "dtype": "f4", "shape": bs}] if bs else []
        elif version in (2, 3, VERSION):
            specs = header["arrays"]
        else:
            raise EdgekvError(f"{path}: session file version {version} is not supported")
        shape = tuple(int(x) for x in header["token_pos_shape"])
        blob_len = int(header["blob_len"])
        if any(s["dtype"] not in ITEM_SIZE for s in specs):
            raise ValueError("unknown array type")
        sizes = [int(np.prod(s["shape"])) * ITEM_SIZE[s["dtype"]] for s in specs]
        if min([blob_len, *shape, *sizes]) < 0:
            raise ValueError("unknown array type or negative size")
        window_spec = header.get("window")
        if any(s["name"] == "window_q" for s in specs):
            window_size = int(window_spec["size"])
            window_layers = tuple(int(x) for x in window_spec["layers"])
        moments_spec = header.get("moments")
        if any(s["name"] == "moments_total" for s in specs):
            moments_at = (int(moments_spec["count"]), int(moments_spec["skip"]),
                          tuple(int(x) for x in moments_spec["layers"]))
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise EdgekvError(f"{path}: session header is corrupt or truncated ({e})") from e
    off = 12 + hl
    n_tp = int(np.prod(shape)) * 4
    if len(data) != off + n_tp + blob_len + sum(sizes):
        raise EdgekvError(f"{path}: session file is truncated or has extra bytes")
    token_pos = np.frombuffer(data[off : off + n_tp], dtype="<i4").reshape(shape).astype(np.int32)
    end = off + n_tp + blob_len
    blob = data[off + n_tp : end]
    arrays: dict[str, np.ndarray] = {}
    for spec, size in zip(specs, sizes, strict=True):
        a = np.frombuffer(data[end : end + size], dtype="<" + spec["dtype"]).reshape(spec["shape"])
        arrays[spec["name"]] = a.astype({"f4": np.float32, "f8": np.float64, "i4": np.int32}[spec["dtype"]])
        end += size
    window = None
    if "window_q" in arrays:
        q, pos = arrays["window_q"], arrays.get("window_pos")
        if (pos is None or q.ndim != 4 or pos.ndim != 1 or q.shape[2] != pos.shape[0]
                or len(window_layers) != q.shape[0] or window_size < 1):
            raise EdgekvError(f"{path}: the saved query window is inconsistent")
        window = QueryWindow(window_size, window_layers, q, pos)
    moments = None
    if "moments_total" in arrays:
        total, outer = arrays["moments_total"], arrays.get("moments_outer")
        count, skip, layers = moments_at
        if (outer is None or total.ndim != 3 or outer.shape != total.shape + total.shape[2:]
                or len(layers) != total.shape[0] or count < 0 or skip < 0):
            raise EdgekvError(f"{path}: the saved query statistics are inconsistent")
        moments = QueryMoments(None, layers, frozenset(), total, outer, count, skip)
    counts, bias = arrays.get("counts"), bool(header.get("bias", False))
    if "bias" in arrays:  # versions 1 and 2 kept the log of the counts, always applied
        counts, bias = np.exp(arrays["bias"]).round().astype(np.float32), True
        if np.all(counts == 1):  # the bias had been switched on, nothing was merged
            counts, bias = None, False
    if counts is not None and (counts.shape != token_pos.shape or not np.all(np.isfinite(counts) & (counts >= 1))):
        raise EdgekvError(f"{path}: the saved merge counts do not match the saved cells or are not counts (>= 1)")
    rot = arrays.get("rot")
    if rot is not None and rot.shape != token_pos.shape:
        raise EdgekvError(f"{path}: the saved key rotations do not match the saved cells")
    try:
        pos_shift = int(header.get("pos_shift", 0))
    except (TypeError, ValueError) as e:
        raise EdgekvError(f"{path}: session header is corrupt ({e})") from e
    ids = arrays.get("ids")
    if ids is not None and ids.ndim != 1:
        raise EdgekvError(f"{path}: the saved token ids are not one row")
    state = CacheState(blob=blob, token_pos=token_pos, engine=engine, counts=counts, bias=bias, window=window,
                       tally=arrays.get("tally"), rot=rot, pos_shift=pos_shift, ids=ids, moments=moments)
    return state, header
