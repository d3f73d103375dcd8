#!/usr/bin/env bash
# One GPU-machine visit of the lead: build, diagnose C++ exceptions, HF integration check, CUDA tests.
#   OUT=/dir bash scripts/gpu_visit.sh
set -u
OUT=${OUT:-/tmp/gpu_visit}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
python3 -c "import torch, sys; print('torch', torch.__version__, torch.version.cuda, 'python', sys.version.split()[0])"
g++ --version | head -1

# The system compiler: see scripts/gpu_check.sh for why (/opt/gcc builds crash on formatted errors).
if [ "${SYSTEM_COMPILER:-1}" = 1 ] && [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED="/usr/bin/gcc -shared"; fi
el "build (abi3) + build (no limited API, copy) + inline extension, in parallel"
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 &
pa=$!
rm -rf /tmp/nolimited && mkdir /tmp/nolimited && cp -r setup.py pyproject.toml README.md csrc hashattention /tmp/nolimited/
(cd /tmp/nolimited && rm -f hashattention/_C*.so && HASHATTENTION_LIMITED_API=0 MAX_JOBS=8 python3 setup.py build_ext --inplace > /tmp/nolimited/build.log 2>&1) &
pb=$!
cat > /tmp/inline_throw.py <<'PY'
import torch
from torch.utils.cpp_extension import load_inline
src = r'''
#include <torch/library.h>
at::Tensor throw_value(const at::Tensor& x) { TORCH_CHECK_VALUE(x.dim() == 99, "x must have 99 dims"); return x; }
at::Tensor throw_plain(const at::Tensor& x) { TORCH_CHECK(x.dim() == 99, "x must have 99 dims"); return x; }
TORCH_LIBRARY(probe, m) { m.def("throw_value(Tensor x) -> Tensor"); m.def("throw_plain(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(probe, CPU, m) { m.impl("throw_value", &throw_value); m.impl("throw_plain", &throw_plain); }
'''
load_inline("probe_ext", src, is_python_module=False, verbose=False)
for name in ("throw_plain", "throw_value"):
    try:
        getattr(torch.ops.probe, name)(torch.zeros(2)); print(name, "no error")
    except Exception as e:
        print(name, type(e).__name__, str(e).splitlines()[0])
PY
(python3 /tmp/inline_throw.py > "$OUT/inline.log" 2>&1; echo "rc=$?" >> "$OUT/inline.log") &
pc=$!
wait $pa; echo "build rc=$?"; tail -3 "$OUT/build.log"
wait $pb; echo "nolimited build rc=$?"; tail -2 /tmp/nolimited/build.log
wait $pc; el "inline extension (a minimal op throwing TORCH_CHECK / TORCH_CHECK_VALUE):"; cat "$OUT/inline.log" | tail -4

probe() {  # $1 = PYTHONPATH root, $2 = label
  for call in "ha.pack_signs(torch.randn(3, 500))" "ha.hamming_scores(torch.zeros(1,2,1,1,dtype=torch.int64), torch.zeros(1,2,5,1,dtype=torch.int32), 2)" "ha.pack_signs(torch.randn(3, 500, device='cuda'))"; do
    PYTHONPATH="$1" python3 -c "import torch, hashattention as ha
try:
    $call; print('no error')
except Exception as e:
    print(type(e).__name__, str(e).splitlines()[0][:90])" > /tmp/probe.out 2>&1
    echo "$2 rc=$? :: $call :: $(tail -1 /tmp/probe.out)"
  done
}
el "probes"
probe "$PWD" "abi3"
probe /tmp/nolimited "no-limited-api"

el "HF integration GPU check"
timeout 240 python3 scripts/gpu_check_integration.py > "$OUT/integration.log" 2>&1; echo "integration rc=$?"
tail -25 "$OUT/integration.log"

el "CUDA pytest (device-parametrized grid + CUDA-only tests), bad-input tests included"
XDIST=""; python3 -c "import xdist" 2>/dev/null && XDIST="-n 14"
timeout ${PYTEST_SECONDS:-200} python3 -m pytest tests/test_encode_signatures.py tests/test_hamming_scores.py tests/test_selection.py \
  tests/test_sparse_attention.py tests/test_pipeline.py tests/test_opcheck.py tests/test_cuda_graphs.py tests/test_cuda_long.py \
  tests/test_bad_inputs.py -k "cuda or bad_input or device_mismatch" -q -rf -p no:cacheprovider $XDIST > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; grep -E "^FAILED|^ERROR|passed|failed|crashed" "$OUT/pytest.log" | tail -30
el done
