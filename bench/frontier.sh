#!/usr/bin/env bash
# The frontier sweep: quality against KV bytes for "quantise, evict, or both?"
#
# Query-agnostic, n = 20 per task, the default tasks (niah_single, niah_multikey,
# vt, multiturn, ppl), on SmolLM2-135M and Qwen2.5-Coder-0.5B, over
#   cache types f16, q8_0, q4_0 (a quantised V cache runs with flash attention),
#   full and the query-agnostic leaders: kvzip, expected_attention, lagkv,
#   streaming_llm, h2o, chelsea,
#   ratios 0.5, 0.75, 0.875.
# Every stage is `edgekv bench quality`, which skips rows already written: stop it
# at any point (or pause it with kill -STOP / -CONT while something else needs the
# cores) and run it again to go on. Hours on 2 cores: SmolLM2 first, then Qwen.
# The tables and plots (accuracy against KV bytes per cache type, among them):
# `edgekv bench report bench/results/smollm2` (reads what is there so far).
set -euo pipefail
cd "$(dirname "$0")/.."
q() { .venv/bin/edgekv bench quality --n 20 --ratios 0.5,0.75,0.875 "$@"; }
CHEAP=full,lagkv,streaming_llm,expected_attention  # fast to score: the first answer to "quantise or evict?"
COSTLY=kvzip,h2o,chelsea                           # kvzip runs the model over the cache per compression
for model in smollm2-135m qwen2.5-coder-0.5b; do
  out=bench/results/smollm2
  [ "$model" = smollm2-135m ] || out=bench/results/$model
  for methods in "$CHEAP" "$COSTLY"; do
    for ct in f16 q8_0 q4_0; do
      q --model "$model" --methods "$methods" --cache-types "$ct" --out "$out"
    done
  done
done
