#!/usr/bin/env bash
# End-to-end A/B of one environment setting of the decode step (a timing aid such as
# HASHATTENTION_ATTENTION_STAGES): scripts/bench_generate.py runs dense once, then the HashAttention
# method ROUNDS times under each value, alternating A, B, A, B, ..., every run in a process of its
# own (the first GPU work of its process, as in benchmarks/results/probe_process_state_20261204_s26.md),
# then scripts/ab_generate_summary.py prints ms per step per value and the ratio to dense.
#
#   OUT=/dir VARIABLE=HASHATTENTION_ATTENTION_STAGES A=0 B=2 bash scripts/ab_generate.sh
#
# Other settings: ROUNDS (2), BATCH (4 on a GPU with more than 100 GB, else 2: B = 4 at 128K needs
# 16 GB of weights + 68.7 GB of KV), CONTEXT (131072), METHOD (hash-query_head-32), RUN_SECONDS (150
# per run), PROFILE_STEPS (0: the profiler's extra steps, kernels by category and launches, off),
# SKIP_DENSE=1 (no dense run: e.g. METHOD=dense to time dense itself under A and B), SKIP_B=1 (value A
# only: one setting's runs, e.g. when device time is short). The inductor cache is
# shared by the runs, so only the first compiles cold. Inductor options are compared through
# VARIABLE=BENCH_INDUCTOR_OPTIONS (read by bench_generate.py), e.g. A=combo_kernels=False B=combo_kernels=True.
set -u
OUT=${OUT:-/tmp/ab_generate}; mkdir -p "$OUT"
: "${VARIABLE:?name the environment variable to compare}" "${A:?value A}" "${B:?value B}"
ROUNDS=${ROUNDS:-2} CONTEXT=${CONTEXT:-131072} METHOD=${METHOD:-hash-query_head-32}
if [ -z "${BATCH:-}" ]; then
  memory_mb=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  BATCH=$([ "${memory_mb:-0}" -gt 100000 ] && echo 4 || echo 2)
fi
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_ab} TORCHINDUCTOR_ENABLE_PDL=1
common=(--contexts "$CONTEXT" --batches "$BATCH" --no-attention-share --paced-steps 0 --profile-steps "${PROFILE_STEPS:-0}" --fresh)
run() {  # run TAG METHOD [VALUE]
  local tag=$1 method=$2 value=${3-}
  echo "== $tag: $method ${value:+$VARIABLE=$value} ($(date -u +%H:%M:%S))"
  local setting=(-u "$VARIABLE")  # dense runs with the variable unset
  [ -n "$value" ] && setting=("$VARIABLE=$value")
  env "${setting[@]}" timeout "${RUN_SECONDS:-150}" python3 scripts/bench_generate.py "${common[@]}" \
    --methods "$method" --out "$OUT/$tag" > "$OUT/$tag.log" 2>&1
  echo "rc=$?"; grep -E "ms/step|Error|error" "$OUT/$tag.log" | tail -3
}
[ "${SKIP_DENSE:-0}" = 1 ] || run dense dense
for round in $(seq 1 "$ROUNDS"); do
  run "a$round" "$METHOD" "$A"
  [ "${SKIP_B:-0}" = 1 ] || run "b$round" "$METHOD" "$B"
done
python3 scripts/ab_generate_summary.py "$OUT" --variable "$VARIABLE" --a-value "$A" --b-value "$B" | tee "$OUT/summary.md"
