"""Conversations on disk, crash-consistent: one record per conversation, rewritten at every turn.

With ``--state-dir``, every conversation that has completed a turn has a record,
``conv-<id>.json``: its messages, the text its cache was fed, its settings and
counters, and the server's shape (model, context size, cache types). The worker
rewrites it atomically (``write_atomic``: temp file, fsync, rename, directory
fsync) before the turn's reply ends, so a server killed at any moment finds every
completed turn on disk.

A conversation's cache is a session file, ``conv-<id>.ekv``, written when the
conversation is moved off its context (least recently used, or at a clean exit).
The record names that file by the SHA-256 the file ends with, and only while the
file holds exactly what the record describes: a completed turn clears the name
(the cache moved on), a save sets it (file first, then record). So at a restart
a record either pairs with its file, byte for byte, and the conversation resumes
from its cache, or it does not, and the conversation is rebuilt from its messages
by a new prefill. No file can pair with the wrong messages: a crash between the
file and the record leaves the old record, which names the old digest.

Servers before this journal wrote one index (``conversations.json``) at a clean
exit; a directory with one is converted to records at start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import EdgekvError
from ..kvcache.files import file_digest, write_atomic
from ..session import Stats

VERSION = 1
OLD_INDEX = "conversations.json"  # what servers before the journal wrote at a clean exit
OLD_INDEX_VERSION = 1


@dataclass
class Entry:
    """One conversation as its record has it: what the store rebuilds it from."""

    id: str
    kind: str
    settings: dict[str, object]  # method, budget, ratio, params
    messages: list[dict[str, str]]
    text: str
    reply_len: int
    requests: int
    last_used: float
    stats: Stats | None
    cache: Path | None  # the session file that holds exactly this state; None: rebuild from messages


def record_path(state_dir: Path, conv_id: str) -> Path:
    return state_dir / f"{conv_id}.json"


def cache_path(state_dir: Path, conv_id: str) -> Path:
    return state_dir / f"{conv_id}.ekv"


def write(state_dir: Path, shape: dict[str, object], entry: Entry) -> None:
    """The conversation's record, atomically: after this returns, a crash cannot lose it."""
    data = {"version": VERSION, "shape": shape, "id": entry.id, "kind": entry.kind, "settings": entry.settings,
            "messages": entry.messages, "text": entry.text, "reply_len": entry.reply_len,
            "requests": entry.requests, "last_used": entry.last_used,
            "stats": entry.stats.as_dict() if entry.stats is not None else None,
            "cache_sha256": file_digest(entry.cache) if entry.cache is not None else None}
    write_atomic(record_path(state_dir, entry.id), [json.dumps(data).encode()])


def remove(state_dir: Path, conv_id: str) -> None:
    """A forgotten conversation: its record, then its cache (a cache no record names is removed
    at the next start anyway)."""
    record_path(state_dir, conv_id).unlink(missing_ok=True)
    cache_path(state_dir, conv_id).unlink(missing_ok=True)


def _shape_error(state_dir: Path, theirs: object, ours: dict[str, object]) -> EdgekvError:
    if not isinstance(theirs, dict):
        theirs = {}
    diff = ", ".join(f"{k} {theirs.get(k)}" for k in ours if theirs.get(k) != ours[k])
    return EdgekvError(f"{state_dir} holds conversations of another server ({diff}); use another --state-dir")


def _entry(data: dict) -> Entry:
    """An entry from a record's (or the old index's) fields; KeyError, TypeError or ValueError
    for one that is not what edgekv writes."""
    conv_id = str(data["id"])
    if not conv_id.startswith("conv-") or "/" in conv_id or "\\" in conv_id:
        raise ValueError(f"bad conversation id {conv_id!r}")
    s = data["settings"]
    settings = {"method": str(s["method"]), "budget": s["budget"], "ratio": s["ratio"], "params": dict(s["params"])}
    messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in data["messages"]]
    if data["kind"] not in ("chat", "completion"):
        raise ValueError(f"bad kind {data['kind']!r}")
    return Entry(id=conv_id, kind=data["kind"], settings=settings, messages=messages, text=str(data["text"]),
                 reply_len=int(data["reply_len"]), requests=int(data["requests"]),
                 last_used=float(data["last_used"]), stats=Stats.from_dict(data["stats"]) if data["stats"] else None,
                 cache=None)


def load(state_dir: Path, shape: dict[str, object]) -> list[Entry]:
    """Every conversation recorded in ``state_dir``, oldest use first, each paired with its
    session file where the file's digest is the one its record names. What pairs with no
    record (a half-written ``.part``, a cache of a conversation whose first turn never ended,
    a cache its record no longer names) is removed.

    A record of another server's shape, or one that does not parse, stops the server with one
    line that names it: this server would otherwise write over conversations it cannot read."""
    _convert_old_index(state_dir, shape)
    for part in state_dir.glob("conv-*.part"):
        part.unlink()
    entries: list[Entry] = []
    for path in sorted(state_dir.glob("conv-*.json")):
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("version") != VERSION:
                raise ValueError("not a record this edgekv writes")
            if data.get("shape") != shape:
                raise _shape_error(state_dir, data.get("shape"), shape)
            entry = _entry(data)
            if entry.id != path.stem:
                raise ValueError(f"it holds conversation {entry.id}")
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as err:
            raise EdgekvError(f"{path} is not a readable conversation record ({err}); "
                              "move it away or use another --state-dir") from None
        cache = cache_path(state_dir, entry.id)
        want = data.get("cache_sha256")
        if want is not None and file_digest(cache) == want:
            entry.cache = cache
        entries.append(entry)
    paired = {e.cache.name for e in entries if e.cache is not None}
    for f in state_dir.glob("conv-*.ekv"):
        if f.name not in paired:
            f.unlink()  # no record names these bytes: a newer state than any record, or an orphan
    entries.sort(key=lambda e: e.last_used)
    return entries


def _convert_old_index(state_dir: Path, shape: dict[str, object]) -> None:
    """The index an earlier edgekv wrote at a clean exit, as records (its files were saved just
    before it, so each pairs with its conversation); then the index goes."""
    path = state_dir / OLD_INDEX
    if not path.is_file():
        return
    try:
        index = json.loads(path.read_text())
        if not isinstance(index, dict) or index.get("version") != OLD_INDEX_VERSION:
            raise ValueError("not an index this edgekv writes")
        theirs = {k: index.get(k) for k in shape}
        if theirs != shape:
            raise _shape_error(state_dir, theirs, shape)
        entries = []
        for e in index["conversations"]:
            entry = _entry(e)
            cache = cache_path(state_dir, entry.id)
            entry.cache = cache if cache.name == Path(e["file"]).name and cache.is_file() else None
            entries.append(entry)
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as err:
        raise EdgekvError(f"{path} is not a readable conversation index ({err}); use another --state-dir") from None
    for entry in entries:
        write(state_dir, shape, entry)
    path.unlink()


__all__ = ["Entry", "VERSION", "cache_path", "load", "record_path", "remove", "write"]
