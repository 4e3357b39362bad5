"""``edgekv models quantize``: llama.cpp's quantiser on the real default model (Q4_1):
the converted file holds the asked weight type, loads and answers; a fresh conversion
is reused; bad input is a one-line error and writes nothing."""

from __future__ import annotations

from collections import Counter

import pytest
from _helpers import run_cli

from edgekv.errors import ModelError
from edgekv.gguf_info import read_gguf_header
from edgekv.llama import Model
from edgekv.quantize import quantize
from edgekv.session import Session


def _types(path) -> Counter:
    return Counter(t.ggml_type.name for t in read_gguf_header(path).tensors)


@pytest.mark.parametrize("type_name", ["q4_0", "q8_0"])
def test_quantize_converts_the_matrices_and_the_model_answers(smollm2_path, tmp_path, monkeypatch,
                                                              type_name) -> None:
    monkeypatch.setenv("EDGEKV_HOME", str(tmp_path))  # the conversion cache
    src = _types(smollm2_path)
    assert src["Q4_1"] > 100  # the default model's matrices
    dest, secs = quantize(smollm2_path, type_name, threads=2)
    assert secs > 0 and dest.is_relative_to(tmp_path) and dest.name.endswith(f".{type_name}.gguf")
    got = _types(dest)
    assert got["Q4_1"] == 0 and got[type_name.upper()] >= src["Q4_1"]
    assert got["F32"] == src["F32"]  # norms stay float
    assert quantize(smollm2_path, type_name) == (dest, 0.0)  # this conversion is cached: reused
    again, secs = quantize(smollm2_path, type_name, tmp_path / "explicit.gguf")
    assert secs > 0 and again.read_bytes() == dest.read_bytes()  # an explicit --out is always written
    model = Model(dest)
    try:
        with Session(model, method="knorm", budget=96, n_ctx=160, n_threads=2) as s:
            s.feed_text("The capital of France is Paris. The capital of Italy is Rome. " * 6)
            assert s.engine.n_cells <= 160
            text = "".join(s.generate(8))
            assert text.strip()
    finally:
        model.close()


def test_quantize_refuses_bad_input(smollm2_path, tmp_path) -> None:
    with pytest.raises(ModelError, match="unknown weight type 'q3_k'"):
        quantize(smollm2_path, "q3_k", tmp_path / "x.gguf")
    with pytest.raises(ModelError, match="overwrite its source"):
        quantize(smollm2_path, "q4_0", smollm2_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelError):
        quantize(bad, "q4_0", tmp_path / "y.gguf")
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "y.gguf").exists()


def test_cli_quantize(smollm2_path, tmp_path) -> None:
    out = tmp_path / "c.q4_0.gguf"
    r = run_cli("models", "quantize", str(smollm2_path), "--type", "q4_0", "--out", str(out))
    assert r.returncode == 0 and str(out) in r.stdout and "converted in" in r.stdout
    r = run_cli("models", "quantize", str(smollm2_path), "--type", "q2")
    assert r.returncode != 0 and "unknown weight type" in r.stderr and "Traceback" not in r.stderr
