// `encode_pair_and_select`: a decode step's selection from the query rows themselves. Exactly
//
//     query_signatures = encode_signatures_pair_into(query, ..., key, ..., key_signatures, positions)
//     indices, counts = hamming_topk(query_signatures, key_signatures, ...)
//
// and so one op where the two are one step of the model, with the two ops' argument checks and
// messages: the composition through the dispatcher, for CPU and CUDA tensors alike (each inner op
// takes its own device's kernels). A one-launch CUDA path, in which the selection kernel computed the
// signatures itself, was measured in three versions and never beat the two launches (H100, B = 2 /
// 128K: 9.04-9.16 and 9.126 ms per step against 8.80 and 9.111), so there is none.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace hashattention {
namespace {

// Returns (indices, counts, query_signatures).
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
  static const auto select =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("hashattention::hamming_topk", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                                    const std::optional<at::Tensor>&, int64_t, int64_t, int64_t,
                                                    int64_t)>();
  at::Tensor query_signatures = encode.call(query, query_weights, query_biases, key, key_weights, key_biases,
                                            key_signatures, positions, activation);
  auto [indices, counts] = select.call(query_signatures, key_signatures, lengths, start_positions, budgets,
                                       selection_heads, sink_tokens, local_tokens, budget_tokens);
  return {indices, counts, query_signatures};
}

}  // namespace

TORCH_LIBRARY_IMPL(hashattention, CPU, m) { m.impl("encode_pair_and_select", &encode_pair_and_select); }
TORCH_LIBRARY_IMPL(hashattention, CUDA, m) { m.impl("encode_pair_and_select", &encode_pair_and_select); }

}  // namespace hashattention
