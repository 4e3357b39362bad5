"""The package's layering, read from the source: lower layers never import upper ones.

    llama.py, ggml_types.py, capture.py   libllama, ggml's types, the eval callback
    kvcache/                              engines over a llama.cpp cache
    methods/                              what to keep, from a snapshot
    config.py                             context options and the budget rule, built once
    session.py                            drives a method over an engine
    cli.py, bench/                        what users run
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "edgekv"
ROOT = PKG.parent


def _imports(path: Path) -> set[str]:
    """Absolute names of the edgekv modules a file imports (relative imports resolved)."""
    mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    pkg = mod.rsplit(".", 1)[0] if path.name != "__init__.py" else mod.removesuffix(".__init__")
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m == "edgekv" or m.startswith("edgekv.")}


FORBIDDEN = [
    ("kvcache", ("edgekv.session", "edgekv.cli", "edgekv.bench", "edgekv.methods")),
    ("methods", ("edgekv.session", "edgekv.cli", "edgekv.bench")),
    ("llama.py", ("edgekv.kvcache", "edgekv.methods", "edgekv.session", "edgekv.cli", "edgekv.bench")),
    ("ggml_types.py", ("edgekv.llama", "edgekv.kvcache", "edgekv.session")),
    ("capture.py", ("edgekv.llama", "edgekv.kvcache", "edgekv.session")),
    ("config.py", ("edgekv.session", "edgekv.cli", "edgekv.bench", "edgekv.server", "edgekv.kvcache")),
    ("session.py", ("edgekv.cli", "edgekv.bench", "edgekv.server")),
]


@pytest.mark.parametrize(("where", "banned"), FORBIDDEN, ids=[w for w, _ in FORBIDDEN])
def test_lower_layers_never_import_upper_ones(where: str, banned: tuple[str, ...]) -> None:
    target = PKG / where
    files = sorted(target.rglob("*.py")) if target.is_dir() else [target]
    assert files
    bad = [(f.relative_to(ROOT), m) for f in files for m in sorted(_imports(f))
           if any(m == b or m.startswith(b + ".") for b in banned)]
    assert not bad, f"upward imports: {bad}"


def test_resolves_relative_imports() -> None:
    # the checker itself: session.py imports the engines relatively
    assert "edgekv.kvcache" in _imports(PKG / "session.py")
    assert "edgekv.errors" in _imports(PKG / "kvcache" / "cells.py")


def test_no_outside_assignment_of_methods_monkeypatching_or_path_hacks() -> None:
    for f in sorted([*PKG.rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        text = f.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    # a Session's method changes through Session.use, never by assignment from outside
                    if isinstance(t, ast.Attribute) and t.attr == "method" and not (
                            isinstance(t.value, ast.Name) and t.value.id == "self"):
                        pytest.fail(f"{f.relative_to(ROOT)}:{node.lineno} assigns .method from outside")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                fn = node.func
                if fn.attr == "__setattr__" and isinstance(fn.value, ast.Name) and fn.value.id == "object":
                    pytest.fail(f"{f.relative_to(ROOT)}:{node.lineno} calls object.__setattr__")
                if fn.attr in ("insert", "append") and isinstance(fn.value, ast.Attribute) and \
                        fn.value.attr == "path" and isinstance(fn.value.value, ast.Name) and fn.value.value.id == "sys":
                    pytest.fail(f"{f.relative_to(ROOT)}:{node.lineno} edits sys.path")


def test_test_modules_do_not_import_each_other() -> None:
    # shared helpers live in tests/_helpers.py, _attention.py and _model_fixture.py
    for f in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom | ast.Import):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(n.startswith("test_") for n in names), f"{f.name} imports {names}"


def test_the_native_engine_uses_only_public_members_of_other_objects() -> None:
    """The native engine builds on the state engine through its public hooks: no
    ``other._private`` access (its own ``self._x`` is its business)."""
    tree = ast.parse((PKG / "kvcache" / "native.py").read_text())
    bad = [(node.lineno, ast.unparse(node)) for node in ast.walk(tree)
           if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
           and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]
    assert not bad, f"private members of other objects: {bad}"


def test_snapshots_are_plain_data() -> None:
    """An engine's snapshot differs from another's by subclassing (``_load`` and the
    accelerators it overrides), never by callables injected into its fields."""
    import dataclasses

    from edgekv.kvcache.native import NativeSnapshot
    from edgekv.kvcache.snapshot import HostSnapshot, KVSnapshot

    for cls in (KVSnapshot, HostSnapshot, NativeSnapshot):
        bad = [f.name for f in dataclasses.fields(cls) if "Callable" in str(f.type) or "->" in str(f.type)]
        assert not bad, f"{cls.__name__} has callable fields {bad}"
    assert NativeSnapshot.accelerators > KVSnapshot.accelerators == frozenset()
