// CPU kernel of `sparse_attention`: exact softmax attention of each query row over the KV rows
// its index list names, read in place from an HF-layout (B, Hkv, N, D) cache (any strides with a
// contiguous last dimension) or a paged (num_pages, page_size, Hkv, D) cache with a block table.
// Accumulates in float32; returns the output in the query dtype and the float32 log-sum-exp.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "checks.h"
#include "outputs.h"
#include "op_arguments.h"

namespace hashattention {

namespace {

// Resolves (batch, kv head, logical position) to the first element of a K or V row.
template <typename scalar_t>
struct CacheRows {
  const scalar_t* data;
  int64_t s0, s1, s2;
  const int32_t* block_table;  // nullptr for the HF layout
  int64_t max_pages, page_size;

  const scalar_t* row(int64_t b, int64_t kv_head, int64_t position) const {
    if (block_table == nullptr) return data + b * s0 + kv_head * s1 + position * s2;
    const int64_t page = block_table[b * max_pages + position / page_size];
    return data + page * s0 + (position % page_size) * s1 + kv_head * s2;
  }
};

template <typename scalar_t>
CacheRows<scalar_t> cache_rows(const at::Tensor& cache, const at::Tensor& block_table, const AttentionDims& dims) {
  return CacheRows<scalar_t>{cache.data_ptr<scalar_t>(), cache.stride(0), cache.stride(1), cache.stride(2),
                             dims.paged ? block_table.data_ptr<int32_t>() : nullptr,
                             dims.paged ? block_table.size(1) : 0, dims.page_size};
}

// q · k over d elements, q already in float32. kLanes independent partial sums: a single running
// sum is a chain of dependent adds that the compiler may not reorder (no -ffast-math), so it ran one
// multiply-add at a time; lanes it can keep in vector registers (SSE at the baseline x86-64 ISA).
// The sum order therefore differs from a left-to-right float loop (both are float32 accumulations;
// the tests compare with the float64 reference).
template <typename scalar_t>
inline float dot_with_query(const float* q, const scalar_t* k, int64_t d) {
  constexpr int kLanes = 16;
  float partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    for (int u = 0; u < kLanes; ++u) partial[u] += q[i + u] * static_cast<float>(k[i + u]);
  }
  for (int u = 0; i < d; ++i, ++u) partial[u] += q[i] * static_cast<float>(k[i]);
  float sum = 0.f;
  for (int u = 0; u < kLanes; ++u) sum += partial[u];
  return sum;
}

// Software prefetch of the row kPrefetchAhead entries further down the index list. The selected
// rows are scattered over the cache, so the hardware prefetchers cannot guess them, and each row
// was a DRAM round trip of its own: gathering 2,048 random rows of 32K per head took 7x as long as
// the first 2,048 (benchmarks/ops_cpu.py, 2-core x86 VM).
constexpr int64_t kPrefetchAhead = 8;

template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t d) {
#if defined(__GNUC__) || defined(__clang__)
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < d * int64_t(sizeof(scalar_t)); offset += 64) __builtin_prefetch(bytes + offset);
#else
  (void)row;
  (void)d;
#endif
}

// The larger of a and b, NaN if either is NaN (std::max keeps a running -inf against a NaN).
inline float max_keeping_nan(float a, float b) { return a > b || std::isnan(a) ? a : b; }

}  // namespace

std::tuple<at::Tensor, at::Tensor> sparse_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                                                        const at::Tensor& value_cache, const at::Tensor& indices,
                                                        const std::optional<at::Tensor>& counts,
                                                        const std::optional<at::Tensor>& block_table,
                                                        double scale, const std::optional<at::Tensor>& workspace) {
  const AttentionDims dims = check_attention_args(query, key_cache, value_cache, indices, counts, block_table);
  check_attention_workspace(workspace, query, dims);  // checked as on CUDA; this kernel needs none
  check_attention_values(dims, key_cache, indices, counts, block_table);

  at::Tensor out = new_output({dims.batch, dims.query_heads, dims.rows, dims.head_dim}, query.options());
  at::Tensor lse = new_output({dims.batch, dims.query_heads, dims.rows}, query.options().dtype(at::kFloat));
  const int64_t row_count = lse.numel();
  if (row_count == 0) return {out, lse};

  const at::Tensor table = dims.paged ? block_table->contiguous() : at::Tensor();
  const at::Tensor count_tensor = counts.has_value() ? counts->contiguous() : at::Tensor();
  const int32_t* count_data = counts.has_value() ? count_tensor.data_ptr<int32_t>() : nullptr;
  const int32_t* index_data = indices.data_ptr<int32_t>();
  const int64_t is0 = indices.stride(0), is1 = indices.stride(1), is2 = indices.stride(2);
  const int64_t d = dims.head_dim;
  const int64_t heads_per_selection = dims.query_heads / dims.selection_heads;
  const int64_t heads_per_kv = dims.query_heads / dims.kv_heads;
  const float scale_f = static_cast<float>(scale);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "sparse_attention_cpu", [&] {
    const auto keys = cache_rows<scalar_t>(key_cache, table, dims);
    const auto values = cache_rows<scalar_t>(value_cache, table, dims);
    const scalar_t* q_data = query.data_ptr<scalar_t>();
    const int64_t qs0 = query.stride(0), qs1 = query.stride(1), qs2 = query.stride(2);
    scalar_t* out_data = out.data_ptr<scalar_t>();
    float* lse_data = lse.data_ptr<float>();

    at::parallel_for(0, row_count, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> q(d), acc(d), logits;
      for (int64_t row = begin; row < end; ++row) {
        const int64_t l = row % dims.rows;
        const int64_t h = (row / dims.rows) % dims.query_heads;
        const int64_t b = row / (dims.rows * dims.query_heads);
        const int64_t s = h / heads_per_selection, kv = h / heads_per_kv;
        const int32_t* list = index_data + b * is0 + s * is1 + l * is2;
        const int64_t used =
            count_data ? count_data[(b * dims.selection_heads + s) * dims.rows + l] : dims.width;
        const scalar_t* qr = q_data + b * qs0 + h * qs1 + l * qs2;
        for (int64_t i = 0; i < d; ++i) q[i] = static_cast<float>(qr[i]) * scale_f;

        // Non-finite inputs give what dense attention (SDPA's math backend, torch.softmax and
        // torch.logsumexp) gives: a NaN logit makes out and lse NaN; a +inf logit gets the weight
        // exp(inf - inf) = NaN, so out is NaN and lse +inf; when every logit is -inf (or nothing is
        // selected) the weights are shifted by 0 instead of the max, so all are 0: out = 0,
        // lse = -inf, as SDPA gives a row whose logits are all -inf. Every selected value row
        // enters as p * v, even at p = 0, so an infinite or NaN value shows as in softmax(...) @ V.
        const float minus_infinity = -std::numeric_limits<float>::infinity();
        logits.assign(used, minus_infinity);
        float max_logit = minus_infinity;
        for (int64_t j = 0; j < used; ++j) {
          if (j + kPrefetchAhead < used && list[j + kPrefetchAhead] >= 0) {
            prefetch_row(keys.row(b, kv, list[j + kPrefetchAhead]), d);
          }
          if (list[j] < 0) continue;  // padding (only reachable without counts)
          const scalar_t* kr = keys.row(b, kv, list[j]);
          const float dot = dot_with_query(q.data(), kr, d);
          logits[j] = dot;
          max_logit = max_keeping_nan(max_logit, dot);
        }
        const float shift = max_logit == minus_infinity ? 0.f : max_logit;
        std::fill(acc.begin(), acc.end(), 0.f);
        float denominator = 0.f;
        for (int64_t j = 0; j < used; ++j) {
          if (j + kPrefetchAhead < used && list[j + kPrefetchAhead] >= 0) {
            prefetch_row(values.row(b, kv, list[j + kPrefetchAhead]), d);
          }
          if (list[j] < 0) continue;
          const float p = std::exp(logits[j] - shift);
          denominator += p;
          const scalar_t* vr = values.row(b, kv, list[j]);
          for (int64_t i = 0; i < d; ++i) acc[i] += p * static_cast<float>(vr[i]);
        }
        // No weight (nothing selected, or every logit -inf): out = acc * 0, which is 0 (NaN where a
        // value was not finite), and lse = -inf + log(0) = -inf.
        const float inv = denominator == 0.f ? 0.f : 1.f / denominator;
        scalar_t* o = out_data + row * d;
        for (int64_t i = 0; i < d; ++i) o[i] = static_cast<scalar_t>(acc[i] * inv);
        lse_data[row] = max_logit == std::numeric_limits<float>::infinity() ? max_logit
                                                                            : max_logit + std::log(denominator);
      }
    });
  });
  return {out, lse};
}

TORCH_LIBRARY_IMPL(hashattention, CPU, m) { m.impl("sparse_attention", &sparse_attention_cpu); }

}  // namespace hashattention
