// The composition behind `encode_pair_and_select` (encode_pair_and_select.cpp), shared by its CPU
// kernel and the general path of its CUDA kernel (csrc/cuda/signatures.cu).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace hashattention {

// encode_signatures_pair_into, then hamming_topk on its query signatures, through the dispatcher.
// Returns (indices, counts, query_signatures).
std::tuple<at::Tensor, at::Tensor, at::Tensor> encode_pair_and_select(
    const at::Tensor& query, at::TensorList query_weights, at::TensorList query_biases, const at::Tensor& key,
    at::TensorList key_weights, at::TensorList key_biases, at::Tensor& key_signatures, const at::Tensor& positions,
    c10::string_view activation, int64_t selection_heads, int64_t sink_tokens, int64_t local_tokens,
    int64_t budget_tokens, const std::optional<at::Tensor>& lengths, const std::optional<at::Tensor>& start_positions,
    const std::optional<at::Tensor>& budgets);

// hamming_topk through the dispatcher.
std::tuple<at::Tensor, at::Tensor> hamming_topk_call(const at::Tensor& query_signatures, const at::Tensor& key_signatures,
                                                     int64_t selection_heads, int64_t sink_tokens, int64_t local_tokens,
                                                     int64_t budget_tokens, const std::optional<at::Tensor>& lengths,
                                                     const std::optional<at::Tensor>& start_positions,
                                                     const std::optional<at::Tensor>& budgets);

}  // namespace hashattention
