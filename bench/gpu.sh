#!/usr/bin/env bash
# The GPU checks, on a machine with a CUDA GPU and edgekv set up with the CUDA backend
# (EDGEKV_CUDA=1 bash scripts/setup.sh):
#   1. the native-op, attention and GPU suites with the shared models and their KV caches
#      on the GPU (EDGEKV_TEST_NGL=-1): every native op takes its ggml graph on CUDA;
#   2. `edgekv bench speed` on the CPU and on the GPU, interleaved per cache type: prefill,
#      each method's one-shot compression of an 8k cache to 1k cells, decode after it.
# Usage: bash bench/gpu.sh [OUT_DIR]   (default bench/results/gpu; PYTHON picks the interpreter;
#        GPU_METHODS, GPU_NGL (default 0,-1) and GPU_TEST_TIMEOUT / GPU_BENCH_TIMEOUT bound the run)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-bench/results/gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -c "from edgekv.kvcache import native_available; assert native_available(), 'no native ops'" || exit 1
status=0
EDGEKV_TEST_NGL=-1 timeout "${GPU_TEST_TIMEOUT:-300}" "$PY" -m pytest -q -p no:cacheprovider -o addopts= --durations=15 \
  --junitxml "$OUT/tests.xml" tests/test_gpu.py tests/test_native.py tests/test_attention.py 2>&1 \
  | tail -n 60 | tee "$OUT/tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout "${GPU_BENCH_TIMEOUT:-300}" "$PY" -m edgekv.cli bench speed --methods "${GPU_METHODS:-all}" --lengths 8k \
  --ratio 0.875 --cache-types f16,q8_0 -ngl "${GPU_NGL:-0,-1}" --no-stream --no-report --out "$OUT" 2>&1 | tee "$OUT/speed.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
