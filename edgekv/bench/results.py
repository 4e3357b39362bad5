"""Where the benchmark scripts in ``bench/`` write, and what every result records."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

#: the repository's ``bench/results`` (the scripts run from a checkout)
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def machine() -> dict[str, object]:
    """The benchmark environment (shared with ``edgekv bench``) plus the commit measured."""
    from .runner import environment

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = "?"
    return {**environment(), "commit": commit}


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path
