// `encode_pair_and_select`: a decode step's selection from the query rows themselves. Exactly
//
//     query_signatures = encode_signatures_pair_into(query, ..., key, ..., key_signatures, positions)
//     indices, counts = hamming_topk(query_signatures, key_signatures, ...)
//
// and so one op where the two are one step of the model. Here it is that composition, through the
// dispatcher, with the two ops' argument checks and messages: the CPU kernel, and the CUDA kernel's
// general path. On CUDA the step can instead run in one launch -- the selection computing the query
// and new-key signatures itself, which removes the encoder launch and the waits around it (0.35 ms per
// step at B = 2 / 128K on an H100: benchmarks/results/ab_encoder_skip_20261205_s36.md); that path
// (csrc/cuda/signatures.cu, csrc/cuda/query_mlp_prologue.cuh) is opt-in: measured slower so far
// (benchmarks/results/ab_fused_selection_20261205_s37.md).
#include "encode_pair_and_select.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace hashattention {

std::tuple<at::Tensor, at::Tensor, at::Tensor> encode_pair_and_select(
    const at::Tensor& query, at::TensorList query_weights, at::TensorList query_biases, const at::Tensor& key,
    at::TensorList key_weights, at::TensorList key_biases, at::Tensor& key_signatures, const at::Tensor& positions,
    c10::string_view activation, int64_t selection_heads, int64_t sink_tokens, int64_t local_tokens,
    int64_t budget_tokens, const std::optional<at::Tensor>& lengths, const std::optional<at::Tensor>& start_positions,
    const std::optional<at::Tensor>& budgets) {
  static const auto encode =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("hashattention::encode_signatures_pair_into", "")
          .typed<at::Tensor(const at::Tensor&, at::TensorList, at::TensorList, const at::Tensor&, at::TensorList,
                            at::TensorList, at::Tensor&, const at::Tensor&, c10::string_view)>();
  at::Tensor query_signatures = encode.call(query, query_weights, query_biases, key, key_weights, key_biases,
                                            key_signatures, positions, activation);
  auto [indices, counts] = hamming_topk_call(query_signatures, key_signatures, selection_heads, sink_tokens, local_tokens,
                                             budget_tokens, lengths, start_positions, budgets);
  return {indices, counts, query_signatures};
}

std::tuple<at::Tensor, at::Tensor> hamming_topk_call(const at::Tensor& query_signatures, const at::Tensor& key_signatures,
                                                     int64_t selection_heads, int64_t sink_tokens, int64_t local_tokens,
                                                     int64_t budget_tokens, const std::optional<at::Tensor>& lengths,
                                                     const std::optional<at::Tensor>& start_positions,
                                                     const std::optional<at::Tensor>& budgets) {
  static const auto select =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("hashattention::hamming_topk", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                                    const std::optional<at::Tensor>&, int64_t, int64_t, int64_t,
                                                    int64_t)>();
  return select.call(query_signatures, key_signatures, lengths, start_positions, budgets, selection_heads, sink_tokens,
                     local_tokens, budget_tokens);
}

TORCH_LIBRARY_IMPL(hashattention, CPU, m) { m.impl("encode_pair_and_select", &encode_pair_and_select); }

}  // namespace hashattention
