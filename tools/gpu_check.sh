#!/usr/bin/env bash
# The one script that builds and checks the CUDA kernels on a GPU machine, then benchmarks them.
# Run it from the repository root:
#
#   OUT=/some/dir bash tools/gpu_check.sh [--no-bench] [--bench-first] [--bench-args "..."]
#   OUT=/some/dir DEADLINE=570 bash tools/gpu_check.sh --bench-first   # within a 10-minute command
#
# 1. builds the extension in place with the CUDA kernels (sm_90; MAX_JOBS defaults to 16);
# 2. runs python -m tools.cuda_error_probe (bad arguments raise Python errors, no crash);
# 3. runs the CUDA tests: pytest over tests/ (all subfolders), filtered to the CUDA cases
#    (PYTEST_FILTER, default "cuda or graph or workspace or cluster or kernel");
# 4. runs tools/cuda_memcheck_cases.py under compute-sanitizer --tool memcheck;
# 5. unless --no-bench, runs python -m benchmarks.decode_attention (arguments from --bench-args),
#    which writes benchmarks/results/decode_attention_<gpu>.{md,json,png}; they are copied to $OUT.
# --bench-first runs step 5 before steps 3-4. DEADLINE (seconds after the start) caps every step's
# timeout by the time left, so that one command stays under a device's time limit and a step cut
# short still leaves the others' logs; a step with under 20 s left is skipped and fails the check.
# Logs go to $OUT (default /tmp/gpu_check). Exit status: non-zero if any step failed.
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
BENCH=1
BENCH_FIRST=0
BENCH_ARGS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --no-bench) BENCH=0 ;;
    --bench-first) BENCH_FIRST=1 ;;
    --bench-args) BENCH_ARGS="$2"; shift ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown option $1 (see --help)"; exit 2 ;;
  esac
  shift
done
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
status=0
step() { echo "== $1 ($(date -u +%H:%M:%S), $(( $(date +%s) - t0 )) s)"; }
t0=$(date +%s)
# Sets $seconds, a step's timeout: its own limit $1, or the time left before DEADLINE if that is shorter.
# Fails, and fails the check, when under 20 s are left (the step is then skipped).
take_time() {
  seconds=$1
  if [ -n "${DEADLINE:-}" ]; then
    local left=$(( DEADLINE - ($(date +%s) - t0) ))
    [ "$left" -lt "$seconds" ] && seconds=$left
  fi
  [ "$seconds" -ge 20 ] && return 0
  echo "skipped: ${seconds} s left before DEADLINE"; status=1; return 1
}

step build
# $OUT keeps only build.log, pytest.log, memcheck.log, bench.log and the benchmark's results files;
# everything else goes to stdout.
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
start=$(date +%s)
# Build with the system compiler: a GPU image whose default CC/CXX (/opt/gcc) differs from the
# runtime libstdc++ links C++ code whose iostreams crash when an error message formats a number
# (every TORCH_CHECK with an integer in its message segfaulted); /usr/bin/gcc matches the runtime.
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED="/usr/bin/gcc -shared"; fi
if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "build took $(( $(date +%s) - start )) s"
python3 -c "import hashattention as ha; assert ha.WITH_CUDA, 'built without CUDA'; print('WITH_CUDA', ha.WITH_CUDA)" || exit 1

step "error probe"
python3 -m tools.cuda_error_probe 2>&1

# xdist (on the GPU image) keeps going if a test crashes its worker.
XDIST=""
python3 -c "import xdist" 2> /dev/null && XDIST="-n 14"

run_tests() {
  step "pytest (CUDA)"
  take_time "${PYTEST_SECONDS:-400}" || return
  # The CUDA cases take about 2 minutes with 14 workers on an H100 or H200: PYTEST_SECONDS (default
  # 400) bounds them; a run that hits the bound fails the check. PYTEST_FILTER picks a subset.
  # -v: with xdist every result line names its test, so a run cut short by its timeout still says
  # which tests failed (a -q run reports failures only at its end).
  # shellcheck disable=SC2086
  timeout "$seconds" python3 -m pytest tests -k "${PYTEST_FILTER:-cuda or graph or workspace or cluster or kernel}" \
    -v -rf -p no:cacheprovider --maxfail=60 $XDIST > "$OUT/pytest.log" 2>&1 || status=1
  echo "$(grep -c " PASSED " "$OUT/pytest.log") passed, $(grep -c " FAILED " "$OUT/pytest.log") failed (result lines)"
  grep -E " FAILED |^FAILED|^ERROR| passed| failed" "$OUT/pytest.log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | sort -u | tail -40
}

run_memcheck() {
  step "compute-sanitizer memcheck"
  if ! command -v compute-sanitizer > /dev/null; then echo "compute-sanitizer not found: skipped"; return; fi
  take_time 150 || return
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$seconds" compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m tools.cuda_memcheck_cases > "$OUT/memcheck.log" 2>&1 || status=1
  tail -6 "$OUT/memcheck.log"
}

run_bench() {
  step benchmark
  take_time 400 || return
  local marker="$OUT/.bench_start"
  touch "$marker"
  # shellcheck disable=SC2086
  timeout "$seconds" python3 -m benchmarks.decode_attention $BENCH_ARGS > "$OUT/bench.log" 2>&1 || status=1
  find benchmarks/results -maxdepth 1 -name 'decode_attention_*' -newer "$marker" -exec cp {} "$OUT/" \;
  rm -f "$marker"
  grep -v "^B=" "$OUT/bench.log" | tail -45
}

[ "$BENCH" = 1 ] && [ "$BENCH_FIRST" = 1 ] && run_bench
run_tests
run_memcheck
[ "$BENCH" = 1 ] && [ "$BENCH_FIRST" = 0 ] && run_bench
step "done, status $status"
exit $status
