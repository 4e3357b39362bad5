#!/usr/bin/env bash
# Run the tests whose verdict depends on ggml's CPU kernels (`pytest -m kernels`) on
# another kernel set than this machine's native build, without touching .venv:
#
#   bash scripts/test_kernels.sh            # avx2: the kernels an AVX2-only CPU runs
#   bash scripts/test_kernels.sh avx2 -x    # extra arguments go to pytest
#
# ggml picks most CPU kernels when it is compiled, so on an AVX-512 machine the
# native build never runs the AVX2 code paths (and the other way round). This
# builds llama-cpp-python with EDGEKV_CPU=<set> (its own key in the wheel cache,
# ~/.cache/edgekv/wheels: about 9 minutes the first time on 2 cores, seconds after)
# into a copy of this checkout under build/cpu-<set>/ with a .venv of its own.
# A copy, because setup.sh compiles edgekv's cffi modules into the source tree,
# linked to one environment's libllama.
set -euo pipefail
cd "$(dirname "$0")/.."
CPU=${1:-avx2}
[ $# -gt 0 ] && shift
case "$CPU" in
  avx2) ;;
  *) echo "[kernels] unknown kernel set '$CPU' (known: avx2)" >&2; exit 2 ;;
esac
DIR=build/cpu-$CPU
mkdir -p "$DIR"
# Refresh the copy (tracked files and untracked ones git does not ignore), keeping its .venv.
find "$DIR" -mindepth 1 -maxdepth 1 ! -name .venv -exec rm -rf {} +
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && printf '%s\0' "$f"
done | tar --null -T - -cf - | tar -xf - -C "$DIR"
echo "[kernels] setting up $DIR (EDGEKV_CPU=$CPU)"
(cd "$DIR" && EDGEKV_CPU=$CPU EDGEKV_SKIP_MODEL=1 bash scripts/setup.sh)
cd "$DIR"
echo "[kernels] cpu features (llama.cpp's kernels): $(.venv/bin/python -c \
  'from edgekv.llama import cpu_features; print(" ".join(cpu_features()))')"
EDGEKV_CPU=$CPU exec .venv/bin/python -m pytest -m kernels "$@"
