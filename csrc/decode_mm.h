// decode_mm: a @ b for the few rows of a decode step (see csrc/cuda/decode_mm.cu for the CUDA kernel).
// The argument checks are shared by the CPU and CUDA implementations.
#pragma once

#include <ATen/ATen.h>

#include "checks.h"

namespace hashattention {

// The most rows of `a` the CUDA kernel takes; more rows go to at::mm (a GEMM that is no longer a
// weight read).
constexpr int64_t kDecodeMmMaxRows = 8;

inline void check_decode_mm_arguments(const at::Tensor& a, const at::Tensor& b) {
  check_dim(a, 2, "decode_mm: a", "(M, K)");
  check_dim(b, 2, "decode_mm: b", "(K, N)");
  TORCH_CHECK_VALUE(a.size(1) == b.size(0), "decode_mm: a (M, K) and b (K, N) must agree in K, got a of shape ",
                    as_text(a.sizes()), " and b of shape ", as_text(b.sizes()));
  check_floating(a, "decode_mm: a");
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), "decode_mm: b must have a's dtype ", as_text(a.scalar_type()),
                   ", got ", as_text(b.scalar_type()));
  check_same_device(b, a, "decode_mm: b", "decode_mm: a");
}

namespace cuda {
// Whether the CUDA kernel takes (a, b) rather than at::mm: bf16 / fp16, 1 <= M <= kDecodeMmMaxRows,
// K a multiple of 8, a row-major and b column-major with 16-byte aligned rows.
bool decode_mm_fast_path(const at::Tensor& a, const at::Tensor& b);
}  // namespace cuda

}  // namespace hashattention
