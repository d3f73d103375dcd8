#include "op_arguments.h"

#include <limits>

#include "checks.h"

namespace hashattention {

namespace {
constexpr int64_t kMaxWords = 32;  // 1024-bit signatures at most
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

bool is_known_activation(const std::string& a) {
  return a == "silu" || a == "relu" || a == "gelu" || a == "tanh" || a == "identity";
}
}  // namespace

namespace {

// The checks of one encoder problem. `names` are the argument names the messages use. With
// `x_heads_divide`, x may have fewer heads than the MLP stack (a divisor of them): MLP head h then
// reads x head h // (heads / x_heads), which is how the key of encode_signatures_pair reads KV-head
// keys for per-query-head MLPs without a repeated copy.
EncodeDims check_encode_problem(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                const std::vector<at::Tensor>& biases, const std::string& activation,
                                const EncodeArgNames& names, bool x_heads_divide) {
  check_floating(x, names.x);
  check_dim(x, 4, names.x, "(batch, heads, tokens, input_dim)");
  check_nonempty_batch(x.size(0), names.x);
  TORCH_CHECK_VALUE(!weights.empty(), as_text(names.weights), " must hold at least one layer, got an empty list");
  TORCH_CHECK_VALUE(weights.size() == biases.size(), as_text(names.weights), " and ", as_text(names.biases),
                    " must have one entry per layer, got ", as_text(weights.size()), " ", as_text(names.weights),
                    " and ", as_text(biases.size()), " ", as_text(names.biases));
  TORCH_CHECK_VALUE(is_known_activation(activation), "activation must be one of 'silu', 'relu', 'gelu', ",
                    "'tanh', 'identity', got '", as_text(activation), "'");
  const int64_t x_heads = x.size(1);
  int64_t heads = x_heads;
  int64_t width = x.size(3);
  const std::string first_weights = std::string(names.weights) + "[0]";
  for (size_t i = 0; i < weights.size(); ++i) {
    const auto wname = std::string(names.weights) + "[" + std::to_string(i) + "]";
    const auto bname = std::string(names.biases) + "[" + std::to_string(i) + "]";
    const at::Tensor& w = weights[i];
    const at::Tensor& b = biases[i];
    check_floating(w, wname.c_str());
    check_floating(b, bname.c_str());
    check_same_device(w, x, wname.c_str(), names.x);
    check_same_device(b, x, bname.c_str(), names.x);
    check_dim(w, 3, wname.c_str(), "(heads, in_features, out_features)");
    if (i == 0 && x_heads_divide) {
      heads = w.size(0);
      TORCH_CHECK_VALUE(x_heads >= 1 && heads % x_heads == 0, as_text(names.x), " heads (", as_text(x_heads),
                        ") must divide ", as_text(wname), " heads (", as_text(heads), "): MLP head h reads ",
                        as_text(names.x), " head h // (", as_text(heads), " / ", as_text(x_heads), ")");
    }
    TORCH_CHECK_VALUE(w.size(0) == heads, as_text(wname), " must have one matrix per head (", as_text(heads),
                      as_text(x_heads_divide ? " heads in " + first_weights : " heads in " + std::string(names.x)),
                      "), got shape ", as_text(w.sizes()));
    TORCH_CHECK_VALUE(w.size(1) == width, as_text(wname), " must have in_features = ", as_text(width),
                      as_text(i == 0 ? " (the last dimension of " + std::string(names.x) + ")"
                                     : std::string(" (out_features of the previous layer)")),
                      ", got shape ", as_text(w.sizes()));
    TORCH_CHECK_VALUE(w.size(2) > 0, as_text(wname), " must have out_features >= 1, got shape ", as_text(w.sizes()));
    width = w.size(2);
    TORCH_CHECK_VALUE(b.dim() == 2 && b.size(0) == heads && b.size(1) == width, as_text(bname),
                      " must have shape (heads, out_features) = (", as_text(heads), ", ", as_text(width), "), got ", as_text(b.sizes()));
  }
  TORCH_CHECK_VALUE(width % 32 == 0, "the last layer's out_features in ", as_text(names.weights),
                    " (the signature bits) must be a multiple of 32, got ", as_text(width));
  return EncodeDims{x.size(0), heads, x.size(2), x.size(3), width, width / 32, x_heads};
}

}  // namespace

EncodeDims check_encode_args(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                             const std::vector<at::Tensor>& biases, const std::string& activation) {
  return check_encode_problem(x, weights, biases, activation, EncodeArgNames{"x", "weights", "biases"}, false);
}

EncodePairDims check_encode_pair_args(const at::Tensor& query, const std::vector<at::Tensor>& query_weights,
                                      const std::vector<at::Tensor>& query_biases, const at::Tensor& key,
                                      const std::vector<at::Tensor>& key_weights,
                                      const std::vector<at::Tensor>& key_biases, const std::string& activation) {
  const EncodeDims q = check_encode_problem(query, query_weights, query_biases, activation,
                                            EncodeArgNames{"query", "query_weights", "query_biases"}, false);
  check_same_device(key, query, "key", "query");
  const EncodeDims k = check_encode_problem(key, key_weights, key_biases, activation,
                                            EncodeArgNames{"key", "key_weights", "key_biases"}, true);
  return EncodePairDims{q, k};
}

EncodePairDims check_encode_pair_into_args(const at::Tensor& query, const std::vector<at::Tensor>& query_weights,
                                           const std::vector<at::Tensor>& query_biases, const at::Tensor& key,
                                           const std::vector<at::Tensor>& key_weights,
                                           const std::vector<at::Tensor>& key_biases, const at::Tensor& key_signatures,
                                           const at::Tensor& positions, const std::string& activation) {
  const EncodePairDims dims =
      check_encode_pair_args(query, query_weights, query_biases, key, key_weights, key_biases, activation);
  const EncodeDims& k = dims.key;
  check_int32(key_signatures, "key_signatures");
  check_same_device(key_signatures, key, "key_signatures", "key");
  check_dim(key_signatures, 4, "key_signatures", "(batch, key heads, slots, words)");
  TORCH_CHECK_VALUE(key_signatures.size(0) == k.batch && key_signatures.size(1) == k.heads &&
                        key_signatures.size(2) >= 1 && key_signatures.size(3) == k.words,
                    "key_signatures must have shape (", as_text(k.batch), ", ", as_text(k.heads), ", slots >= 1, ",
                    as_text(k.words), ") for key of shape ", as_text(key.sizes()), " and ", as_text(k.heads),
                    " key MLP heads of ", as_text(k.bits), " bits, got ", as_text(key_signatures.sizes()));
  check_dtype(positions, at::kLong, "positions");
  check_same_device(positions, key, "positions", "key");
  TORCH_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == k.tokens, "positions must have shape (",
                    as_text(k.tokens), ",): one cache slot per token of key, got ", as_text(positions.sizes()));
  return dims;
}

void check_store_positions_cpu(const at::Tensor& positions, int64_t slots) {
  const at::Tensor sorted = std::get<0>(positions.sort());
  const int64_t count = sorted.numel();
  if (count == 0) return;
  const int64_t* p = sorted.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(p[0] >= 0 && p[count - 1] < slots, "positions must lie in [0, ", as_text(slots),
                    ") (the slots of key_signatures), got values from ", as_text(p[0]), " to ", as_text(p[count - 1]));
  for (int64_t i = 1; i < count; ++i) {
    TORCH_CHECK_VALUE(p[i] != p[i - 1], "positions must be distinct, got ", as_text(p[i]), " twice");
  }
}

int64_t check_pack_args(const at::Tensor& values) {
  TORCH_CHECK_TYPE(at::isFloatingType(values.scalar_type()), "values must be a floating-point tensor, got ",
                   as_text(values.scalar_type()));
  TORCH_CHECK_VALUE(values.dim() >= 1, "values must have at least one dimension (..., bits)");
  const int64_t bits = values.size(-1);
  TORCH_CHECK_VALUE(bits > 0 && bits % 32 == 0, "values last dimension (bits) must be a positive multiple ",
                    "of 32, got ", as_text(bits));
  return bits;
}

HammingDims check_hamming_args(const at::Tensor& q, const at::Tensor& k, int64_t selection_heads) {
  check_int32(q, "query_signatures");
  check_int32(k, "key_signatures");
  check_dim(q, 4, "query_signatures", "(batch, query_heads, rows, words)");
  check_dim(k, 4, "key_signatures", "(batch, key_heads, keys, words)");
  check_same_device(k, q, "key_signatures", "query_signatures");
  check_nonempty_batch(q.size(0), "query_signatures");
  TORCH_CHECK_VALUE(k.size(0) == q.size(0), "key_signatures batch (", as_text(k.size(0)),
                    ") must equal query_signatures batch (", as_text(q.size(0)), ")");
  TORCH_CHECK_VALUE(k.size(3) == q.size(3), "key_signatures words (", as_text(k.size(3)),
                    ") must equal query_signatures words (", as_text(q.size(3)), ")");
  TORCH_CHECK_VALUE(q.size(3) >= 1 && q.size(3) <= kMaxWords, "signatures must have 1 to ", as_text(kMaxWords),
                    " int32 words (32 to 1024 bits), got ", as_text(q.size(3)));
  const int64_t hq = q.size(1), hk = k.size(1);
  TORCH_CHECK_VALUE(hq >= 1 && hk >= 1 && hq % hk == 0, "key_signatures heads (", as_text(hk),
                    ") must divide query_signatures heads (", as_text(hq),
                    "): one key head per query head, or one per KV group");
  TORCH_CHECK_VALUE(selection_heads >= 1 && hq % selection_heads == 0, "selection_heads (",
                    as_text(selection_heads), ") must divide query_signatures heads (", as_text(hq),
                    "): use the query heads (per-head selection) or the KV heads (group-shared)");
  check_last_dim_contiguous(q, "query_signatures");
  check_last_dim_contiguous(k, "key_signatures");
  return HammingDims{q.size(0), hq, hk, selection_heads, q.size(2), k.size(2), q.size(3)};
}

SelectionArgs check_selection_args(const std::optional<at::Tensor>& lengths,
                                   const std::optional<at::Tensor>& start_positions,
                                   const std::optional<at::Tensor>& budgets, int64_t batch,
                                   const at::Tensor& ref, const char* ref_name, int64_t keys, const char* keys_name,
                                   int64_t sink, int64_t local, int64_t budget) {
  TORCH_CHECK_VALUE(sink >= 0 && sink <= kInt32Max, "sink_tokens must be in [0, 2^31 - 1], got ", as_text(sink));
  TORCH_CHECK_VALUE(local >= 0 && local <= kInt32Max, "local_tokens must be in [0, 2^31 - 1], got ", as_text(local));
  TORCH_CHECK_VALUE(budget >= 0 && budget <= kInt32Max, "budget_tokens must be in [0, 2^31 - 1], got ",
                    as_text(budget));
  TORCH_CHECK_VALUE(sink + local + budget >= 1,
                    "sink_tokens + local_tokens + budget_tokens must be >= 1 (nothing would be selected)");
  TORCH_CHECK_VALUE(sink + local + budget <= kInt32Max, "sink_tokens + local_tokens + budget_tokens (",
                    as_text(sink + local + budget), ") is the output width and must fit in int32");
  TORCH_CHECK_VALUE(keys <= kInt32Max, as_text(keys_name), " has ", as_text(keys),
                    " keys; the selected positions are int32, so at most 2^31 - 1 keys are supported");
  check_per_sequence(lengths, batch, ref, "lengths", ref_name);
  check_per_sequence(start_positions, batch, ref, "start_positions", ref_name);
  check_per_sequence(budgets, batch, ref, "budgets", ref_name);
  return SelectionArgs{sink, local, budget};
}

ScoreSelectionDims check_score_selection_args(const at::Tensor& scores, const std::optional<at::Tensor>& lengths,
                                              const std::optional<at::Tensor>& start_positions,
                                              const std::optional<at::Tensor>& budgets, int64_t sink_tokens,
                                              int64_t local_tokens, int64_t budget_tokens) {
  const auto dtype = scores.scalar_type();
  TORCH_CHECK_TYPE(!at::isComplexType(dtype) && dtype != at::kBool, "scores must be a real (integer or ",
                   "floating-point) tensor, got ", as_text(dtype));
  check_dim(scores, 4, "scores", "(batch, selection_heads, rows, keys)");
  check_nonempty_batch(scores.size(0), "scores");
  const SelectionArgs selection =
      check_selection_args(lengths, start_positions, budgets, scores.size(0), scores, "scores", scores.size(3),
                           "scores", sink_tokens, local_tokens, budget_tokens);
  return ScoreSelectionDims{scores.size(0), scores.size(1), scores.size(2), scores.size(3), selection};
}

void check_selection_values(const std::optional<at::Tensor>& lengths,
                            const std::optional<at::Tensor>& start_positions, int64_t keys) {
  const int64_t batch = lengths.has_value() ? lengths->size(0)
                        : start_positions.has_value() ? start_positions->size(0)
                                                      : 0;
  const at::Tensor len = lengths.has_value() ? lengths->contiguous() : at::Tensor();
  const at::Tensor st = start_positions.has_value() ? start_positions->contiguous() : at::Tensor();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = lengths.has_value() ? len.data_ptr<int32_t>()[b] : keys;
    TORCH_CHECK_VALUE(length >= 0 && length <= keys, "lengths[", as_text(b), "] = ", as_text(length),
                      " must be in [0, N] where N = ", as_text(keys), " is the number of cached keys");
    if (start_positions.has_value()) {
      const int64_t s = st.data_ptr<int32_t>()[b];
      TORCH_CHECK_VALUE(s >= 0 && s <= length, "start_positions[", as_text(b), "] = ", as_text(s),
                        " must be in [0, lengths[", as_text(b), "]] = [0, ", as_text(length), "]");
    }
  }
}

AttentionDims check_attention_args(const at::Tensor& query, const at::Tensor& key_cache,
                                   const at::Tensor& value_cache, const at::Tensor& indices,
                                   const std::optional<at::Tensor>& counts,
                                   const std::optional<at::Tensor>& block_table) {
  check_floating(query, "query");
  check_dim(query, 4, "query", "(batch, query_heads, rows, head_dim)");
  check_nonempty_batch(query.size(0), "query");
  check_last_dim_contiguous(query, "query");
  TORCH_CHECK_TYPE(key_cache.scalar_type() == query.scalar_type(), "key_cache must have the query's dtype (",
                   as_text(query.scalar_type()), "), got ", as_text(key_cache.scalar_type()));
  TORCH_CHECK_TYPE(value_cache.scalar_type() == query.scalar_type(),
                   "value_cache must have the query's dtype (", as_text(query.scalar_type()), "), got ",
                   as_text(value_cache.scalar_type()));
  check_same_device(key_cache, query, "key_cache", "query");
  check_same_device(value_cache, query, "value_cache", "query");
  check_same_device(indices, query, "indices", "query");
  check_last_dim_contiguous(key_cache, "key_cache");
  check_last_dim_contiguous(value_cache, "value_cache");

  const int64_t batch = query.size(0), hq = query.size(1), rows = query.size(2), d = query.size(3);
  TORCH_CHECK_VALUE(is_supported_head_dim(d), "query head_dim must be 64, 128 or 256, got ", as_text(d));
  const bool paged = block_table.has_value();
  const char* layout = paged ? "(num_pages, page_size, kv_heads, head_dim) with a block_table"
                             : "(batch, kv_heads, keys, head_dim)";
  check_dim(key_cache, 4, "key_cache", layout);
  check_dim(value_cache, 4, "value_cache", layout);
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), "value_cache shape ", as_text(value_cache.sizes()),
                    " must equal key_cache shape ", as_text(key_cache.sizes()));
  TORCH_CHECK_VALUE(key_cache.size(3) == d, "key_cache head_dim (", as_text(key_cache.size(3)),
                    ") must equal query head_dim (", as_text(d), ")");
  int64_t hkv, keys, page_size;
  if (paged) {
    const at::Tensor& bt = *block_table;
    check_int32(bt, "block_table");
    check_same_device(bt, query, "block_table", "query");
    TORCH_CHECK_VALUE(bt.dim() == 2 && bt.size(0) == batch, "block_table must have shape (batch, max_pages) ",
                      "with batch = ", as_text(batch), ", got ", as_text(bt.sizes()));
    page_size = key_cache.size(1);
    TORCH_CHECK_VALUE(page_size >= 1, "key_cache page_size (dimension 1) must be >= 1");
    hkv = key_cache.size(2);
    keys = bt.size(1) * page_size;
  } else {
    TORCH_CHECK_VALUE(key_cache.size(0) == batch, "key_cache batch (", as_text(key_cache.size(0)),
                      ") must equal query batch (", as_text(batch), ")");
    hkv = key_cache.size(1);
    keys = key_cache.size(2);
    page_size = 1;
  }
  TORCH_CHECK_VALUE(hkv >= 1 && hq % hkv == 0, "KV heads (", as_text(hkv), ") must divide query heads (", as_text(hq), ")");

  check_int32(indices, "indices");
  check_dim(indices, 4, "indices", "(batch, selection_heads, rows, width)");
  check_last_dim_contiguous(indices, "indices");
  TORCH_CHECK_VALUE(indices.size(0) == batch && indices.size(2) == rows, "indices must have shape (batch=",
                    as_text(batch), ", selection_heads, rows=", as_text(rows), ", width), got ", as_text(indices.sizes()));
  const int64_t hs = indices.size(1);
  TORCH_CHECK_VALUE(hs >= 1 && hq % hs == 0, "indices selection_heads (", as_text(hs), ") must divide query heads (",
                    as_text(hq), ")");
  if (counts.has_value()) {
    check_int32(*counts, "counts");
    check_same_device(*counts, query, "counts", "query");
    TORCH_CHECK_VALUE(counts->dim() == 3 && counts->size(0) == batch && counts->size(1) == hs &&
                          counts->size(2) == rows,
                      "counts must have shape (batch, selection_heads, rows) = (", as_text(batch), ", ", as_text(hs), ", ",
                      as_text(rows), "), got ", as_text(counts->sizes()));
  }
  return AttentionDims{batch, hq, hkv, hs, rows, d, indices.size(3), paged, keys, page_size};
}

void check_attention_workspace(const std::optional<at::Tensor>& workspace, const at::Tensor& query,
                               const AttentionDims& dims) {
  if (!workspace.has_value()) return;
  check_int32(*workspace, "workspace");
  check_same_device(*workspace, query, "workspace", "query");
  TORCH_CHECK_VALUE(workspace->is_contiguous(), "workspace must be contiguous");
  const int64_t needed = dims.batch * dims.query_heads * dims.rows;
  TORCH_CHECK_VALUE(workspace->numel() >= needed, "workspace must have at least batch * query_heads * rows = ",
                    as_text(needed), " elements, got ", as_text(workspace->numel()));
}

void check_attention_values(const AttentionDims& dims, const at::Tensor& key_cache,
                            const at::Tensor& indices, const std::optional<at::Tensor>& counts,
                            const std::optional<at::Tensor>& block_table) {
  const at::Tensor idx = indices.contiguous();
  const at::Tensor cnt = counts.has_value() ? counts->contiguous() : at::Tensor();
  const at::Tensor bt = block_table.has_value() ? block_table->contiguous() : at::Tensor();
  const int32_t* ip = idx.data_ptr<int32_t>();
  const int64_t row_count = dims.batch * dims.selection_heads * dims.rows;
  const int64_t pages = dims.paged ? key_cache.size(0) : 0;
  const int64_t max_pages = dims.paged ? bt.size(1) : 0;
  for (int64_t r = 0; r < row_count; ++r) {
    int64_t used = dims.width;
    if (counts.has_value()) {
      used = cnt.data_ptr<int32_t>()[r];
      TORCH_CHECK_VALUE(used >= 0 && used <= dims.width, "counts must be in [0, width=", as_text(dims.width),
                        "], got ", as_text(used), " at flat row ", as_text(r));
    }
    const int64_t b = r / (dims.selection_heads * dims.rows);
    for (int64_t j = 0; j < used; ++j) {
      const int64_t p = ip[r * dims.width + j];
      if (p < 0 && !counts.has_value()) continue;  // -1 padding is skipped when counts are absent
      TORCH_CHECK_VALUE(p >= 0 && p < dims.keys, "indices must be in [0, ", as_text(dims.keys), ") for the ",
                        as_text((dims.paged ? "paged cache (max_pages * page_size)" : "cache length N")), ", got ", as_text(p),
                        " at flat row ", as_text(r), ", entry ", as_text(j));
      if (dims.paged) {
        const int64_t page = bt.data_ptr<int32_t>()[b * max_pages + p / dims.page_size];
        TORCH_CHECK_VALUE(page >= 0 && page < pages, "block_table[", as_text(b), ", ", as_text(p / dims.page_size), "] = ", as_text(page),
                          " must be in [0, num_pages=", as_text(pages), ")");
      }
    }
  }
}

}  // namespace hashattention
