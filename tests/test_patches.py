"""edgekv's sources copy into, and the patch set applies cleanly, in order, to the pinned
llama.cpp source (the llama-cpp-python sdist that setup downloads); every patch stays small
and its README names it."""

from __future__ import annotations

import importlib.util
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _build_llama():
    spec = importlib.util.spec_from_file_location("build_llama", ROOT / "native" / "build_llama.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_patches_apply_in_order_to_the_pinned_source(tmp_path) -> None:
    bl = _build_llama()
    sdist = bl.fetch_sdist()
    prefix = f"llama_cpp_python-{bl.VERSION}/vendor/llama.cpp/"
    wanted = ("CMakeLists.txt", "include/", "src/")
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(prefix) and m.name[len(prefix):].startswith(wanted)]
        tf.extractall(tmp_path, members=members, filter="data")
    src = tmp_path / f"llama_cpp_python-{bl.VERSION}"
    patches = bl.patches()
    assert [p.name[:4] for p in patches] == [f"{i:04d}" for i in range(1, len(patches) + 1)]
    bl.apply_patches(src)  # exits with the rejected hunk if one does not apply
    vendor = src / "vendor" / "llama.cpp"
    header = (vendor / "include" / "llama-edgekv.h").read_text()
    from edgekv.kvcache.native import NATIVE_API

    # the header's version is the one the bindings are written for
    assert f"LLAMA_EDGEKV_API_VERSION {NATIVE_API}" in header and "enum llama_edgekv_status" in header
    assert "llama_edgekv_seq_compact" in (vendor / "src" / "llama-edgekv.cpp").read_text()
    # edgekv's files are copies of native/llama/; the patches only edit llama.cpp's own files
    for rel in bl.sources():
        assert (vendor / rel).read_bytes() == (bl.SOURCE_DIR / rel).read_bytes()
    for p in patches:
        text = p.read_text()
        assert "--- /dev/null" not in text and "@@ -0,0 " not in text, f"{p.name} adds a file"
        added = sum(1 for ln in text.splitlines() if ln.startswith("+") and not ln.startswith("+++"))
        assert added <= 300, f"{p.name} adds {added} lines"
    assert not list(vendor.rglob("*.rej"))
    readme = (ROOT / "ggml_patches" / "README.md").read_text()
    for p in patches:
        assert f"`{p.name}`" in readme


def test_a_changed_source_changes_the_wheel_key(tmp_path, monkeypatch) -> None:
    """A wheel built from other sources is never reused: the key hashes every copied file."""
    bl = _build_llama()
    before, stock = bl.build_key(False), bl.build_key(False, stock=True)
    fake = tmp_path / "llama"
    for rel in bl.sources():
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_bytes((bl.SOURCE_DIR / rel).read_bytes())
    monkeypatch.setattr(bl, "SOURCE_DIR", fake)
    assert bl.build_key(False) == before
    cpp = fake / "src" / "llama-edgekv.cpp"
    cpp.write_bytes(cpp.read_bytes() + b"\n")
    assert bl.build_key(False) != before
    assert bl.build_key(False, stock=True) == stock  # a stock build has none of edgekv's sources


def test_the_installed_gguf_py_is_the_vendored_llama_cpps() -> None:
    """Tiny models are written with the installed ``gguf``: it must be the copy inside the
    pinned llama.cpp (setup installs it), whose names are the ones libllama loads."""
    import gguf

    bl = _build_llama()
    member = f"llama_cpp_python-{bl.VERSION}/vendor/llama.cpp/gguf-py/gguf/constants.py"
    with tarfile.open(bl.fetch_sdist()) as tf:
        vendored = tf.extractfile(member).read()
    assert (Path(gguf.__file__).parent / "constants.py").read_bytes() == vendored
