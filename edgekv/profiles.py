"""Per-model calibration profiles (CompressKV's semantic retrieval heads), on disk.

A profile belongs to one GGUF file: it is stored under
``$EDGEKV_HOME/profiles/<sha256 of the file>.json`` and found again by the
same hash, so a renamed copy of the model finds it and a re-quantised one
does not. ``edgekv calibrate MODEL`` writes it (``edgekv/calibrate.py``). The
registry models' profiles ship with edgekv (``models/profiles/``), made by the
same command; a user's own calibration takes precedence.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

from .errors import EdgekvError
from .models import edgekv_home


@dataclass
class HeadProfile:
    """Retrieval-head scores of one model: ``scores[layer][query_head]`` (mean attention
    mass on the answer span per successful calibration run), for the ``layers`` the
    cache compresses (model layer ids), and the calibration that produced them."""

    model: str
    sha256: str
    layers: list[int]
    scores: list[list[float]]
    runs: int
    successful: int
    grid: dict = field(default_factory=dict)

    def top_heads(self, row: int, k: int) -> list[int]:
        """The ``k`` best query heads of layer row ``row`` (ties: lower head id first)."""
        s = self.scores[row]
        return sorted(range(len(s)), key=lambda h: (-s[h], h))[:k]


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file, hashed once per (path, size, modification time) in a process."""
    st = os.stat(path)
    return _sha256(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@cache
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def profile_path(sha256: str) -> Path:
    return edgekv_home() / "profiles" / f"{sha256}.json"


def shipped_profile_path(sha256: str) -> Path | None:
    """The profile edgekv ships for a registry model (``models/profiles/``, made by
    ``edgekv calibrate`` with its defaults), so compresskv runs on a fresh machine; from
    the wheel (``edgekv/_data``) or the source tree. None for any other file."""
    here = Path(__file__).resolve().parent
    for d in (here / "_data" / "profiles", here.parent / "models" / "profiles"):
        if (d / f"{sha256}.json").is_file():
            return d / f"{sha256}.json"
    return None


def save_profile(profile: HeadProfile, path: str | os.PathLike[str] | None = None) -> Path:
    """Write atomically to ``path`` (default: the model's profile location)."""
    path = Path(path) if path else profile_path(profile.sha256)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    tmp.write_text(json.dumps(asdict(profile), indent=1))
    tmp.replace(path)
    return path


def load_profile(model_path: str | os.PathLike[str], path: str | os.PathLike[str] | None = None) -> HeadProfile:
    """The profile of ``model_path`` (or the file ``path``): the user's own calibration first,
    then the one shipped for registry models; a clear error when there is none."""
    if path:
        p = Path(path)
    else:
        sha = file_sha256(model_path)
        p = profile_path(sha)
        p = p if p.is_file() else shipped_profile_path(sha) or p
    if not p.is_file():
        name = Path(model_path).name
        raise EdgekvError(f"no CompressKV profile for {name}: run `edgekv calibrate {model_path}` once "
                          "(a few minutes on 2 cores), or pass --param profile=FILE")
    try:
        d = json.loads(p.read_text())
        return HeadProfile(**d)
    except (ValueError, TypeError) as e:
        raise EdgekvError(f"{p}: not a CompressKV profile ({e})") from e
