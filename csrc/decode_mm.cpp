// decode_mm on the CPU: exactly at::mm, after the op's argument checks (the op exists so that a compiled
// decode step can call the CUDA kernel in csrc/cuda/decode_mm.cu; on the CPU nothing beats at::mm).
#include <torch/library.h>

#include "decode_mm.h"

namespace hashattention {

at::Tensor decode_mm_cpu(const at::Tensor& a, const at::Tensor& b) {
  check_decode_mm_arguments(a, b);
  return at::mm(a, b);
}

TORCH_LIBRARY_IMPL(hashattention, CPU, m) { m.impl("decode_mm", &decode_mm_cpu); }

}  // namespace hashattention
