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
# cores) and run it again to go on.
#
# The stages run in the order that answers the most first (hours on 2 cores):
#   1. SmolLM2, the cheap methods on every cache type (done: 2 h);
#   2. SmolLM2, the costly methods on f16 (kvzip runs the model over the cache
#      per compression; about 4 h per cache type);
#   3. Qwen, the cheap methods on every cache type (the quantised rows answer
#      "quantise or evict?" on the model where eviction keeps most; 2 to 3 h each);
#   4. Qwen, kvzip on f16, ratio 0.5 first: the issue's Qwen targets rest on it
#      (h2o and chelsea on f16 are in the results already);
#   5. SmolLM2, the costly methods on q8_0 (half done when Qwen moved ahead);
#   6. the costly methods on the rest: SmolLM2 q4_0, Qwen q8_0 and q4_0.
# The tables and plots (accuracy against KV bytes per cache type, among them):
# `edgekv bench report bench/results/smollm2` (reads what is there so far).
set -euo pipefail
cd "$(dirname "$0")/.."
CHEAP=full,lagkv,streaming_llm,expected_attention  # fast to score: the first answer to "quantise or evict?"
COSTLY=kvzip,h2o,chelsea                           # kvzip runs the model over the cache per compression
stage() {  # MODEL METHODS CACHE_TYPE [RATIOS]
  local out=bench/results/smollm2
  [ "$1" = smollm2-135m ] || out=bench/results/$1
  .venv/bin/edgekv bench quality --n 20 --ratios "${4:-0.5,0.75,0.875}" \
    --model "$1" --methods "$2" --cache-types "$3" --out "$out"
}
for ct in f16 q8_0 q4_0; do stage smollm2-135m "$CHEAP" "$ct"; done
stage smollm2-135m "$COSTLY" f16
for ct in f16 q8_0 q4_0; do stage qwen2.5-coder-0.5b "$CHEAP" "$ct"; done
stage qwen2.5-coder-0.5b kvzip f16 0.5
stage qwen2.5-coder-0.5b kvzip f16
stage smollm2-135m "$COSTLY" q8_0
stage smollm2-135m "$COSTLY" q4_0
for ct in q8_0 q4_0; do stage qwen2.5-coder-0.5b "$COSTLY" "$ct"; done
