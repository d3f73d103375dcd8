#!/usr/bin/env bash
# One GPU-machine visit of the lead, batched: build, focused CUDA tests, per-kernel profile,
# a B = 1 decode benchmark and the HF integration check (bf16, then float32).
#   OUT=/dir bash scripts/gpu_visit.sh [tests|profile|ncu|ncu_source|probe|memcheck|bench|integration|generate|states|frozen|all ...]
# Every step has its own timeout so that one visit stays under the 10-minute command limit.
set -u
OUT=${OUT:-/tmp/gpu_visit}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
STEPS=${*:-all}
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
want() { [[ " $STEPS " == *" $1 "* || " $STEPS " == *" all "* ]]; }
python3 -c "import torch, sys; print('torch', torch.__version__, torch.version.cuda, 'python', sys.version.split()[0])"
# The system compiler: see scripts/gpu_check.sh for why (/opt/gcc builds crash on formatted errors).
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED="/usr/bin/gcc -shared"; fi
el build
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
python3 -c "import hashattention as ha; assert ha.WITH_CUDA; print('WITH_CUDA')" || exit 1
XDIST=""; python3 -c "import xdist" 2>/dev/null && XDIST="-n 14"

if want tests; then
  el "CUDA tests (${TEST_FILES:-selection fast path, selection grid, regressions, graphs})"
  # -v: with xdist every result line names its test, so a timeout still says what failed.
  timeout ${TEST_SECONDS:-240} python3 -m pytest ${TEST_FILES:-tests/test_cuda_selection_chunks.py tests/test_selection.py \
    tests/test_cuda_regressions.py tests/test_cuda_graphs.py} -k "${TEST_FILTER:-cuda or chunks or regressions or graphs}" \
    -v -rf -p no:cacheprovider --maxfail=30 $XDIST > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?"; grep -E "FAILED|ERROR|passed|failed|crashed" "$OUT/pytest.log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | sort | uniq | tail -25
  grep -E "^E  " "$OUT/pytest.log" | head -12
fi
if want profile; then
  el "per-kernel profile"
  timeout 90 python3 scripts/profile_ops.py --n 32768 131072 524288 > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
  cat "$OUT/profile.log" | head -60
fi
if want ncu; then
  el "Nsight Compute counters of the selection, attention and encoder kernels (128K, per query head)"
  timeout ${NCU_SECONDS:-120} ncu --clock-control none -k "regex:${NCU_KERNELS:-resident_select|fast_|fused_mlp|sparse_attention}" \
    --set detailed -c ${NCU_COUNT:-8} python3 scripts/profile_ops.py --n ${NCU_N:-131072} --selection ${NCU_SELECTION:-query_head} --batch ${NCU_BATCH:-1} \
    --eager 2 --encode-batches 1 > "$OUT/ncu.txt" 2>&1; echo "ncu rc=$?"
  grep -E "^  [a-z_]+.*\(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|L2 Hit" "$OUT/ncu.txt" | head -60
fi
if [[ " $STEPS " == *" ncu_source "* ]]; then  # not part of "all": a full-set profile is slow
  el "Nsight Compute hot spots per SASS instruction (build with HASHATTENTION_LINEINFO=1 for source lines)"
  timeout ${NCU_SECONDS:-150} ncu --clock-control none -k "regex:${NCU_KERNELS:-resident_select}" --set full \
    --import-source yes -c 1 -f -o "$OUT/ncu_source" python3 scripts/profile_ops.py --n ${NCU_N:-131072} \
    --selection ${NCU_SELECTION:-query_head} --batch ${NCU_BATCH:-4} --eager 1 --encode-batches > "$OUT/ncu_source.log" 2>&1
  echo "ncu rc=$?"
  ncu -i "$OUT/ncu_source.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_source_sass.csv" 2>&1
  python3 scripts/ncu_hotspots.py "$OUT/ncu_source_sass.csv" --top 40
fi
if want probe; then
  el "selection phase times (scripts/probe_selection.py)"
  timeout ${PROBE_SECONDS:-120} python3 scripts/probe_selection.py ${PROBE_ARGS:-} > "$OUT/probe.log" 2>&1
  echo "probe rc=$?"; tail -20 "$OUT/probe.log"
fi
if want memcheck; then
  el "compute-sanitizer memcheck"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${MEMCHECK_SECONDS:-150} compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 scripts/cuda_memcheck_smoke.py > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -5 "$OUT/memcheck.log"
fi
if want bench; then
  el "decode benchmark B=1"
  timeout ${BENCH_SECONDS:-150} python3 scripts/bench_decode.py --out "$OUT" ${BENCH_ARGS:---batches 1 --ns 32768 131072 524288 --repeats 50} \
    > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
  grep -v "^B=" "$OUT/bench.log" | tail -30
fi
if want integration; then
  el "HF integration check bf16 (both models) and float32 (llama)"
  timeout ${INTEGRATION_SECONDS:-200} python3 scripts/gpu_check_integration.py --model ${INTEGRATION_MODEL:-both} \
    > "$OUT/integration.log" 2>&1
  echo "integration bf16 rc=$?"; grep -E "PASS|FAIL|Error|error" "$OUT/integration.log" | tail -14
  timeout ${INTEGRATION_SECONDS:-200} python3 scripts/gpu_check_integration.py --model llama --dtype float32 \
    > "$OUT/integration_fp32.log" 2>&1
  echo "integration fp32 rc=$?"; grep -E "PASS|FAIL|Error|error" "$OUT/integration_fp32.log" | tail -8
fi
if want generate; then
  el "end-to-end generate benchmark"
  timeout ${GENERATE_SECONDS:-300} python3 scripts/bench_generate.py --out "$OUT" ${GENERATE_ARGS:-} \
    > "$OUT/generate.log" 2>&1; echo "generate rc=$?"; tail -${GENERATE_TAIL:-30} "$OUT/generate.log"
fi
if [[ " $STEPS " == *" states "* ]]; then  # not part of "all"
  # B = 4 per head is bimodal across processes (benchmarks/results/bench_generate_20261203_s21_states.md:
  # the same kernels, less GPU idle time between graph nodes when the warm-cached compile is the process's
  # first GPU work): the same method twice, each in its own process, the first compiling cold and the
  # second from the warm cache, both traced (python scripts/timeline_gaps.py COLD --compare WARM).
  el "one method, two processes (cold then warm compile cache), traced"
  for state in cold warm; do
    timeout ${STATES_SECONDS:-200} python3 scripts/bench_generate.py --contexts 131072 --batches ${STATES_BATCH:-4} \
      --methods ${STATES_METHOD:-hash-query_head-32} --no-attention-share --fresh --profile-steps 12 \
      --out "$OUT/states/$state" --trace-dir "$OUT/states/$state" > "$OUT/states_$state.log" 2>&1
    echo "$state rc=$?"; grep -E "first call|ms/step|CUDA-graph replays" "$OUT/states_$state.log"
  done
fi
if [[ " $STEPS " == *" frozen "* ]]; then  # not part of "all"
  # Frozen weights with q | k | v merged (hashattention/inductor_passes.py) against inductor's defaults, for
  # both methods, every run its own process (benchmarks/results/bench_generate_20261206_s39_freezing_h100.md).
  el "frozen weights + concat_projections A/B (HashAttention per head, then dense)"
  # The runs write into /tmp and only the summaries and rows are copied: the device returns at most 8 files.
  # FROZEN_AB=0 runs the frozen setting alone (a1 = the frozen run): the ratio in half the device time.
  # FROZEN_PASS=concat_projections_keep_layout: the merged weights column-major (hashattention/inductor_passes.py).
  # FROZEN_AB=layout: the two layouts of the merged weights against each other (A row-major, B kept).
  frozen="freezing=True,post_grad_custom_pre_pass='${FROZEN_PASS:-concat_projections}'"
  a_value=freezing=False skip_b=0
  [ "${FROZEN_AB:-1}" = 0 ] && a_value=$frozen skip_b=1
  [ "${FROZEN_AB:-1}" = layout ] && a_value="freezing=True,post_grad_custom_pre_pass='concat_projections'" \
    frozen="freezing=True,post_grad_custom_pre_pass='concat_projections_keep_layout'"
  # FROZEN_BATCHES="4 1": each batch size in turn, files named frozen_b<B>_<method>.* (default: the one batch
  # scripts/ab_generate.sh picks for the GPU's memory, files frozen_<method>.*). With two batch sizes the
  # successful build's log is dropped so that the 8 files of results come back.
  batches=(${FROZEN_BATCHES:-auto})
  for batch in "${batches[@]}"; do
    tag="" batch_env=()
    [ "$batch" != auto ] && tag="b${batch}_" batch_env=(BATCH="$batch")
    for method in hash-query_head-32 dense; do
      run_dir="/tmp/frozen_$tag$method"
      env "${batch_env[@]}" OUT="$run_dir" VARIABLE=BENCH_INDUCTOR_OPTIONS A="$a_value" B="$frozen" ROUNDS=1 \
        SKIP_DENSE=1 SKIP_B=$skip_b METHOD=$method PROFILE_STEPS=3 RUN_SECONDS=${FROZEN_RUN_SECONDS:-150} \
        bash scripts/ab_generate.sh | tail -6
      cat "$run_dir/summary.md" "$run_dir"/{a1,b1}.log > "$OUT/frozen_$tag$method.txt" 2>/dev/null
      python3 -c "import glob, json, sys; print(json.dumps({run: [json.load(open(f)) for f in glob.glob(f'{sys.argv[1]}/{run}/*.json')]
        for run in ('a1', 'b1')}))" "$run_dir" > "$OUT/frozen_$tag$method.json"
    done
  done
  [ ${#batches[@]} -gt 1 ] && rm -f "$OUT/build.log"
fi
el done
