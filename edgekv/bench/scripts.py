"""The single-purpose benchmarks in a checkout's ``bench/``, reachable from one entry:
``edgekv bench list`` names them, ``edgekv bench run NAME [ARGS]`` runs one.

Each script is ordinary user code (it imports edgekv, parses its own arguments and
writes to ``bench/results/`` through ``results.py``); this module only finds and
runs them, so a benchmark is one file and needs no registration.
"""

from __future__ import annotations

import ast
import re
import sys

from ..errors import EdgekvError
from .results import RESULTS

SCRIPTS = RESULTS.parent  # the checkout's bench/


def scripts() -> dict[str, str]:
    """name -> what it measures (its docstring's first sentence), for every script in ``bench/``."""
    if not SCRIPTS.is_dir():
        raise EdgekvError(f"the benchmark scripts live in a checkout's bench/ ({SCRIPTS} does not exist); "
                          "clone the repository to run them")
    out = {}
    for path in sorted(SCRIPTS.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        para = " ".join(doc.split("\n\n")[0].split())
        end = re.search(r"[.?](\s|$)", para)
        first = para[: end.start() + 1] if end else para
        out[path.stem] = first if len(first) <= 110 else first[:107].rsplit(" ", 1)[0] + " ..."
    return out


def run(name: str, args: list[str]) -> int:
    """Run ``bench/NAME.py`` as its own ``__main__`` with ``args``; its exit status.
    Executed in this process (not ``runpy``, which would show the file as the program)."""
    known = scripts()
    if name.removesuffix(".py") not in known:
        raise EdgekvError(f"no benchmark {name!r}; one of: {', '.join(known)}")
    name = name.removesuffix(".py")
    argv = sys.argv
    sys.argv = [f"edgekv bench run {name}", *args]  # argparse shows this as the program
    path = SCRIPTS / f"{name}.py"
    try:
        code = compile(path.read_text(encoding="utf-8"), str(path), "exec")
        exec(code, {"__name__": "__main__", "__file__": str(path), "__builtins__": __builtins__})
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    return 0
