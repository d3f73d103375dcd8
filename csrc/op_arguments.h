// Validation of each op's arguments, shared by the CPU and CUDA implementations so that
// both reject exactly the same inputs with the same messages. Only checks that need no
// device data live here; value checks that read tensors (lengths <= N, index ranges) are
// done by the CPU kernels alone, since reading device memory would force a host sync.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace hashattention {

struct EncodeDims {
  int64_t batch, heads, tokens, input_dim, bits, words;
  int64_t x_heads;  // heads of x: `heads`, or a divisor of it for the key of encode_signatures_pair
  // MLP head h reads x head h / heads_per_x_head().
  int64_t heads_per_x_head() const { return x_heads == 0 ? 1 : heads / x_heads; }
};
// Argument names used in the messages of one encoder problem.
struct EncodeArgNames {
  const char* x;
  const char* weights;
  const char* biases;
};
EncodeDims check_encode_args(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                             const std::vector<at::Tensor>& biases, const std::string& activation);

// encode_signatures_pair: the query problem as encode_signatures checks it; the key problem the
// same, except that key (B, Hx, N, D) may have fewer heads than key_weights: Hx must divide them.
// Messages name query/query_weights/... and key/key_weights/... .
struct EncodePairDims {
  EncodeDims query, key;
};
EncodePairDims check_encode_pair_args(const at::Tensor& query, const std::vector<at::Tensor>& query_weights,
                                      const std::vector<at::Tensor>& query_biases, const at::Tensor& key,
                                      const std::vector<at::Tensor>& key_weights,
                                      const std::vector<at::Tensor>& key_biases, const std::string& activation);

// encode_signatures_pair_into: the pair's checks, then the store's: key_signatures int32
// (B', Hk, S, Wk) on the key's device with B', Hk and Wk those of the key problem and S >= 1, and
// positions int64 (N,) (N = the key's tokens) on the same device. The positions' values are checked
// where they can be read without a device sync (check_store_positions_cpu).
EncodePairDims check_encode_pair_into_args(const at::Tensor& query, const std::vector<at::Tensor>& query_weights,
                                           const std::vector<at::Tensor>& query_biases, const at::Tensor& key,
                                           const std::vector<at::Tensor>& key_weights,
                                           const std::vector<at::Tensor>& key_biases, const at::Tensor& key_signatures,
                                           const at::Tensor& positions, const std::string& activation);
// positions (CPU): every value in [0, slots) and no value twice.
void check_store_positions_cpu(const at::Tensor& positions, int64_t slots);

// pack_signs: returns the number of bits (a positive multiple of 32) of `values` (..., bits).
int64_t check_pack_args(const at::Tensor& values);

struct HammingDims {
  int64_t batch, query_heads, key_heads, selection_heads, rows, keys, words;
  int64_t heads_per_selection() const { return query_heads / selection_heads; }
  int64_t query_heads_per_key_head() const { return query_heads / key_heads; }
  // Largest score a row can reach: bits per head times the heads summed into it.
  int64_t max_score() const { return 32 * words * heads_per_selection(); }
};
HammingDims check_hamming_args(const at::Tensor& query_signatures, const at::Tensor& key_signatures,
                               int64_t selection_heads);

struct SelectionArgs {
  int64_t sink, local, budget;
  int64_t width() const { return sink + local + budget; }
};
// The window sizes, the per-sequence tensors (on ref's device), and the number of keys, held by
// the tensor named keys_name: the selected positions are int32, so `keys` must fit in int32.
SelectionArgs check_selection_args(const std::optional<at::Tensor>& lengths,
                                   const std::optional<at::Tensor>& start_positions,
                                   const std::optional<at::Tensor>& budgets, int64_t batch,
                                   const at::Tensor& ref, const char* ref_name, int64_t keys, const char* keys_name,
                                   int64_t sink_tokens, int64_t local_tokens, int64_t budget_tokens);
struct ScoreSelectionDims {
  int64_t batch, heads, rows, keys;
  SelectionArgs selection;
};
// topk_from_scores: scores (B, Hs, L, N) of a real dtype, plus the selection arguments.
ScoreSelectionDims check_score_selection_args(const at::Tensor& scores, const std::optional<at::Tensor>& lengths,
                                              const std::optional<at::Tensor>& start_positions,
                                              const std::optional<at::Tensor>& budgets, int64_t sink_tokens,
                                              int64_t local_tokens, int64_t budget_tokens);

// CPU only: lengths in [0, keys], start in [0, length].
void check_selection_values(const std::optional<at::Tensor>& lengths,
                            const std::optional<at::Tensor>& start_positions, int64_t keys);

struct AttentionDims {
  int64_t batch, query_heads, kv_heads, selection_heads, rows, head_dim, width;
  bool paged;
  int64_t keys;       // HF layout: N; paged: max_pages * page_size (logical positions)
  int64_t page_size;  // 1 for the HF layout
};
AttentionDims check_attention_args(const at::Tensor& query, const at::Tensor& key_cache,
                                   const at::Tensor& value_cache, const at::Tensor& indices,
                                   const std::optional<at::Tensor>& counts,
                                   const std::optional<at::Tensor>& block_table);
// sparse_attention's optional workspace: int32, contiguous, on the query's device, at least
// batch * query_heads * rows elements.
void check_attention_workspace(const std::optional<at::Tensor>& workspace, const at::Tensor& query,
                               const AttentionDims& dims);
// CPU only: every used index in [0, keys) and every used block-table entry in [0, pages).
void check_attention_values(const AttentionDims& dims, const at::Tensor& key_cache,
                            const at::Tensor& indices, const std::optional<at::Tensor>& counts,
                            const std::optional<at::Tensor>& block_table);

}  // namespace hashattention
