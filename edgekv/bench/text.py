"""Real English text for haystacks and perplexity: Jane Austen's six novels.

Source: Debian's ``r-cran-janeaustenr`` package (the CRAN package janeaustenr
1.0.0 by Julia Silge, texts from Project Gutenberg, public domain; package MIT
licensed). It installs an R lazy-load database under
``/usr/lib/R/site-library/janeaustenr/data/Rdata.{rdx,rdb}``: a gzip'd RDS
index of (offset, length) records, each a zlib-compressed serialised R
character vector with one line of the book per element. This module reads
that format directly (no R needed at run time), so the text is:

- installed by ``apt-get install --no-install-recommends r-cran-janeaustenr``
  (what ``scripts/setup.sh`` should run), or
- unpacked without root by ``edgekv bench text --fetch`` (``apt-get download``
  plus ``dpkg-deb -x`` into ``$EDGEKV_HOME/text``), or
- found in any directory named by ``$EDGEKV_TEXT_DIR`` that holds
  ``janeaustenr/data/Rdata.rdx``.

The texts are read once per process and cached.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import struct
import subprocess
import tempfile
import zlib
from functools import cache
from pathlib import Path

from ..errors import EdgekvError

DEBIAN_PACKAGE = "r-cran-janeaustenr"
BOOKS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility")
SOURCE = (
    "Jane Austen's six novels (Project Gutenberg, public domain) as shipped by Debian's "
    f"{DEBIAN_PACKAGE} (CRAN janeaustenr 1.0.0)"
)
INSTALL_HINT = (
    f"the benchmark text is Debian's {DEBIAN_PACKAGE}: run "
    f"`apt-get install --no-install-recommends {DEBIAN_PACKAGE}` (root) or "
    "`edgekv bench text --fetch` (no root: apt-get download + dpkg-deb -x into the edgekv cache)"
)


def _candidates() -> list[Path]:
    from ..models import edgekv_home

    out = []
    env = os.environ.get("EDGEKV_TEXT_DIR")
    if env:
        out.append(Path(env).expanduser())
    out += [
        edgekv_home() / "text" / "usr" / "lib" / "R" / "site-library",
        Path("/usr/lib/R/site-library"),
        Path("/usr/local/lib/R/site-library"),
        Path("/usr/lib/R/library"),
    ]
    return out


def find_data_dir() -> Path:
    """The janeaustenr ``data`` directory, or an EdgekvError that says how to install it."""
    for base in _candidates():
        d = base / "janeaustenr" / "data"
        if (d / "Rdata.rdx").is_file() and (d / "Rdata.rdb").is_file():
            return d
    raise EdgekvError(INSTALL_HINT)


def fetch(dest: Path | None = None) -> Path:
    """Unpack the Debian package into ``dest`` (default ``$EDGEKV_HOME/text``) without root."""
    from ..models import edgekv_home

    dest = dest or edgekv_home() / "text"
    dest.mkdir(parents=True, exist_ok=True)
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise EdgekvError(f"{tool} not found: fetching the text needs a Debian-based system ({INSTALL_HINT})")
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run(["apt-get", "download", DEBIAN_PACKAGE], cwd=tmp, capture_output=True, text=True)
        debs = list(Path(tmp).glob("*.deb"))
        if r.returncode != 0 or not debs:
            raise EdgekvError(f"apt-get download {DEBIAN_PACKAGE} failed: {r.stderr.strip()[-300:]}")
        r = subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(dest)], capture_output=True, text=True)
        if r.returncode != 0:
            raise EdgekvError(f"dpkg-deb -x failed: {r.stderr.strip()[-300:]}")
    books.cache_clear()
    sentences.cache_clear()
    vocabulary.cache_clear()
    return dest


# ---------------------------------------------------------------------------
# A reader for R's serialisation format (XDR, versions 2 and 3), just enough
# for lazy-load indexes and character vectors.


class _RReader:
    def __init__(self, data: bytes) -> None:
        self.b = data
        self.i = 0
        self.refs: list[object] = []

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.b, self.i)
        self.i += 4
        return v

    def _bytes(self, n: int) -> bytes:
        v = self.b[self.i : self.i + n]
        self.i += n
        return v

    def read(self) -> object:
        if self._bytes(2) != b"X\n":
            raise EdgekvError("R data: only XDR serialisation is supported")
        version = self._int()
        self._int()  # writer R version
        self._int()  # minimal reader version
        if version == 3:
            self._bytes(self._int())  # native encoding name
        elif version != 2:
            raise EdgekvError(f"R data: serialisation version {version} is not supported")
        return self._item()

    def _item(self) -> object:
        flags = self._int()
        typ = flags & 0xFF
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))
        if typ in (254, 242, 241, 253, 252, 251, 247):  # NILVALUE, env/special singletons
            return None
        if typ == 255:  # REFSXP
            idx = flags >> 8
            if idx == 0:
                idx = self._int()
            return self.refs[idx - 1]
        if typ == 1:  # SYMSXP
            sym = self._item()
            self.refs.append(sym)
            return sym
        if typ == 9:  # CHARSXP
            n = self._int()
            return None if n == -1 else self._bytes(n).decode("utf-8", "replace")
        if typ in (2, 6, 17):  # LISTSXP / LANGSXP / DOTSXP: a pairlist
            out: dict[object, object] = {}
            while typ in (2, 6, 17):
                if has_attr:
                    self._item()
                tag = self._item() if has_tag else len(out)
                out[tag] = self._item()
                flags = self._int()
                typ, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
            if typ != 254:
                raise EdgekvError("R data: malformed pairlist")
            return out
        if typ in (10, 13):  # LGLSXP, INTSXP
            n = self._int()
            val: object = list(struct.unpack_from(f">{n}i", self.b, self.i))
            self.i += 4 * n
        elif typ == 14:  # REALSXP
            n = self._int()
            val = list(struct.unpack_from(f">{n}d", self.b, self.i))
            self.i += 8 * n
        elif typ in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            n = self._int()
            val = [self._item() for _ in range(n)]
        else:
            raise EdgekvError(f"R data: SEXP type {typ} is not supported")
        if has_attr:
            attrs = self._item()
            names = attrs.get("names") if isinstance(attrs, dict) else None
            if isinstance(names, list) and isinstance(val, list) and len(names) == len(val):
                return dict(zip(names, val, strict=True))
        return val


def _unserialize(data: bytes) -> object:
    return _RReader(data).read()


def _read_lazyload(data_dir: Path) -> dict[str, list[str]]:
    index = _unserialize(gzip.decompress((data_dir / "Rdata.rdx").read_bytes()))
    if not isinstance(index, dict) or not isinstance(index.get("variables"), dict):
        raise EdgekvError(f"{data_dir}/Rdata.rdx is not an R lazy-load index")
    blob = (data_dir / "Rdata.rdb").read_bytes()
    out: dict[str, list[str]] = {}
    for name, (off, length) in index["variables"].items():
        rec = blob[off : off + length]
        raw = zlib.decompress(rec[4:])  # 4-byte big-endian length, then a zlib stream
        if len(raw) != struct.unpack(">I", rec[:4])[0]:
            raise EdgekvError(f"R data: record {name} has the wrong length")
        lines = _unserialize(raw)
        if not isinstance(lines, list):
            raise EdgekvError(f"R data: {name} is not a character vector")
        out[str(name)] = [x or "" for x in lines]
    return out


def _paragraphs(lines: list[str]) -> list[str]:
    """Join wrapped lines into paragraphs; drop headings (VOLUME/CHAPTER lines) and italics marks."""
    paras: list[str] = []
    cur: list[str] = []
    for ln in lines + [""]:
        s = ln.strip()
        if s:
            cur.append(s)
            continue
        if cur:
            p = " ".join(cur).replace("_", "")
            p = re.sub(r"\s+", " ", p).strip()
            if len(p) > 40 and not re.fullmatch(r"(VOLUME|CHAPTER|Chapter)\b.*", p):
                paras.append(p)
            cur = []
    return paras


@cache
def books() -> dict[str, list[str]]:
    """Each book as a list of paragraphs (plain text, one paragraph per string)."""
    raw = _read_lazyload(find_data_dir())
    missing = [b for b in BOOKS if b not in raw]
    if missing:
        raise EdgekvError(f"janeaustenr data lacks {', '.join(missing)}")
    return {b: _paragraphs(raw[b]) for b in BOOKS}


_SENT = re.compile(r"(?<!Mr\.)(?<!Mrs\.)(?<!Dr\.)(?<!St\.)(?<!Ms\.)(?<=[.!?])\s+(?=[A-Z\"'])")


@cache
def sentences() -> list[str]:
    """All sentences of all books, in book order; the haystack material."""
    out: list[str] = []
    for b in BOOKS:
        for p in books()[b]:
            out += [s for s in _SENT.split(p) if s]
    return out


@cache
def vocabulary(min_len: int = 4) -> list[str]:
    """Distinct lower-case alphabetic words of the books, sorted (for common-word tasks)."""
    words: set[str] = set()
    for b in BOOKS:
        for p in books()[b]:
            words.update(w for w in re.findall(r"[a-z]+", p.lower()) if len(w) >= min_len)
    return sorted(words)


def available() -> bool:
    try:
        find_data_dir()
        return True
    except EdgekvError:
        return False
