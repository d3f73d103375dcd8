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

// Whether encode_signatures_pair's two problems share one launch: both pass
// fused_encode_applies, with the same x dtype and the same weight dtype (one instantiation).
bool fused_encode_pair_applies(const at::Tensor& query, at::TensorList query_weights, at::TensorList query_biases,
                               const at::Tensor& key, at::TensorList key_weights, at::TensorList key_biases);

// Writes the packed signatures of x (B, Hx, N, D), any strides, into out: contiguous int32
// (B, H, N, bits / 32), where H = weights[0].size(0) and Hx divides H (MLP head h reads x head
// h / (H / Hx); Hx = H for encode_signatures). Arguments as validated by check_encode_args or
// check_encode_pair_args. One launch.
void encode_fused_cuda(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                       const std::string& activation, at::Tensor& out);

// Both problems of encode_signatures_pair (each as in encode_fused_cuda) in ONE launch of the
// same kernel; requires fused_encode_pair_applies. With key_positions (int64 (N,), defined), key_out
// is a cache (B, H, S, words) with contiguous words and key token n goes to slot key_positions[n]
// (slots outside [0, S) are skipped: encode_signatures_pair_into).
void encode_fused_pair_cuda(const at::Tensor& query, at::TensorList query_weights, at::TensorList query_biases,
                            at::Tensor& query_out, const at::Tensor& key, at::TensorList key_weights,
                            at::TensorList key_biases, at::Tensor& key_out, const std::string& activation,
                            const at::Tensor& key_positions = at::Tensor());

}  // namespace cuda
}  // namespace hashattention
