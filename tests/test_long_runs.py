"""Short versions of the long runs (bench/long_runs.py, bench/server_load.py as a soak),
each within about two minutes: cells bounded, the sinks and the window never evicted,
greedy repeating itself, every answer well formed, nothing left busy or leaked. Memory
flatness needs the long versions (bench/RESULTS.md); these say they are too short."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(script: str, out: Path, *args: str) -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args, "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("method,budget,n_ctx,turns", [("lagkv", 320, 512, 50), ("chelsea", 128, 256, 40)])
def test_a_scripted_chat(tmp_path, method: str, budget: int, n_ctx: int, turns: int) -> None:
    d = _run("long_runs.py", tmp_path / "chat.json", "chat", "--method", method, "--budget", str(budget),
             "--n-ctx", str(n_ctx), "--turns", str(turns), "--repeat", str(turns), "--check-every", "2")
    assert d["ok"] and d["repeat"]["same"] and d["compressions"] >= 2
    assert 0 < d["drift"]["max_cells"] <= n_ctx and d["drift"]["flat"] is None  # too short to judge


def test_a_long_generation(tmp_path) -> None:
    d = _run("long_runs.py", tmp_path / "gen.json", "generate", "--method", "lagkv", "--tokens", "700",
             "--repeat", "700", "--check-every", "2")
    assert d["ok"] and d["repeat"]["same"] and d["compressions"] >= 2 and d["drift"]["max_cells"] <= 512


def test_a_server_soak_with_walkaways_and_bad_requests(tmp_path) -> None:
    d = _run("server_load.py", tmp_path / "soak.json", "--conversations", "6", "--turns", "4", "--max-tokens",
             "12", "--max-live", "2", "--clients", "3", "--max-conversations", "4", "--disconnect", "0.3", "--bad",
             "0.5", "--seed", "3")
    assert d["config"]["clients"] == 3 and d["server"]["conversations"] <= 4  # the oldest idle ones forgotten
    assert d["ok"] and d["walked_away"] >= 1 and d["malformed_requests"] >= 3 and not d["errors"], d["failed_checks"]
    assert d["server"]["busy"] == 0 and d["server"]["active_requests"] == 0 and d["server"]["live"] <= 2
