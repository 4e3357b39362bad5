"""The README's embedding and server examples run as written (a newcomer copies them)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def block(name: str) -> str:
    """The fenced block right after ``<!-- tested: name -->`` in the README."""
    m = re.search(rf"<!-- tested: {name} -->\n```\w*\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert m, f"README has no block marked 'tested: {name}'"
    return m.group(1)


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "EDGEKV_HOME": os.environ.get("EDGEKV_HOME", str(Path.home() / ".cache" / "edgekv"))}


@pytest.mark.slow
def test_the_embedding_example(tmp_path, smollm2_path) -> None:
    r = subprocess.run([sys.executable, "-c", block("embed")], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600, env=_env(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[compressed]" in r.stdout  # two turns of up to 160 tokens outgrow n_ctx 256
    assert re.search(r"\n\d+ cells, [1-9]\d* compressions\n", r.stdout)
    assert (tmp_path / "story.ekv").stat().st_size > 0


@pytest.mark.slow
def test_the_server_example_with_its_client(tmp_path, smollm2_path) -> None:
    import socket

    with socket.socket() as probe:  # a server already there would answer in the README's place
        if probe.connect_ex(("127.0.0.1", 8765)) == 0:
            pytest.fail("port 8765, which the README's example uses, is taken by another program")
    (cmd,) = [line for line in block("serve").splitlines() if line.strip()]
    argv = shlex.split(cmd)
    argv[0] = str(BIN / Path(argv[0]).name)  # .venv/bin/edgekv of this interpreter
    server = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE, text=True, env=_env(tmp_path))
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen("http://127.0.0.1:8765/v1/models", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    pytest.fail(f"the README's server did not start: {server.stderr.read()[-2000:]}")
                time.sleep(0.2)
        r = subprocess.run([sys.executable, "-c", block("client")], cwd=tmp_path, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        lines = r.stdout.strip().splitlines()
        assert lines[-1] == "True" and "'conversation': 'conv-" in r.stdout and "'method': 'snapkv'" in r.stdout
    finally:
        server.send_signal(signal.SIGINT)
        code = server.wait(timeout=60)
    assert code == 0, server.stderr.read()[-2000:]
