// The fused few-rows encoder of the CUDA encode_signatures (encode_fused.cu). CUDA sources only.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace hashattention {
namespace cuda {

// Whether the fused kernel handles these validated arguments: at most 64 rows per head
// (batch * tokens: decode steps and short chunks), at most 8 layers, widths <= 1024, x in
// float32/float16/bfloat16, and one of those dtypes for all weights and biases. Otherwise the
// cuBLAS path runs.
bool fused_encode_applies(const at::Tensor& x, at::TensorList weights, at::TensorList biases);

// Writes the packed signatures of x (B, H, N, D), any strides, into out: contiguous int32
// (B, H, N, bits / 32). Arguments as validated by check_encode_args.
void encode_fused_cuda(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                       const std::string& activation, at::Tensor& out);

}  // namespace cuda
}  // namespace hashattention
