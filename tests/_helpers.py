"""Helpers several test modules share (test modules never import each other)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(sys.executable).parent / "edgekv"
CMD = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "edgekv.cli"]


def prefill(eng, toks: list[int], batch: int = 128) -> None:
    """Empty the engine's sequence and decode ``toks`` into it, ``batch`` at a time."""
    eng.reset()
    for i in range(0, len(toks), batch):
        eng.decode(toks[i : i + batch], i)


def run_cli(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real ``edgekv`` console script in a subprocess."""
    env = dict(os.environ)
    env.pop("EDGEKV_VERBOSE", None)  # llama.cpp's log would land on stderr
    env.update(COLUMNS="200", NO_COLOR="1", TERM="dumb", PYTHONUNBUFFERED="1")
    return subprocess.run(
        [*CMD, *map(str, args)],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
