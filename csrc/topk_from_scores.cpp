// CPU kernel of `topk_from_scores`: the selection contract of `hamming_topk` applied to
// precomputed scores of any real dtype, so every selector (exact top-k oracle, Quest, H2O,
// ...) shares one budget contract and one attention op.
//
// Ranking: higher score first; equal scores go to the later position; NaN ranks below
// everything (so a NaN is only chosen when nothing else is left).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "checks.h"
#include "outputs.h"
#include "selection_cpu.h"

namespace hashattention {

namespace {

template <typename T>
bool is_nan(T v) {
  if constexpr (std::is_floating_point_v<T>) {
    return std::isnan(v);
  } else {
    return false;
  }
}

// Half and bfloat16 compare as float; everything else in its own type (int64 stays exact).
template <typename scalar_t>
using compare_t = std::conditional_t<std::is_same_v<scalar_t, at::Half> || std::is_same_v<scalar_t, at::BFloat16>,
                                     float, scalar_t>;

}  // namespace

std::tuple<at::Tensor, at::Tensor> topk_from_scores_cpu(const at::Tensor& scores,
                                                        const std::optional<at::Tensor>& lengths,
                                                        const std::optional<at::Tensor>& start_positions,
                                                        const std::optional<at::Tensor>& budgets,
                                                        int64_t sink_tokens, int64_t local_tokens,
                                                        int64_t budget_tokens) {
  const ScoreSelectionDims dims = check_score_selection_args(scores, lengths, start_positions, budgets, sink_tokens,
                                                             local_tokens, budget_tokens);
  const auto dtype = scores.scalar_type();
  const int64_t batch = dims.batch, heads = dims.heads, rows = dims.rows, keys = dims.keys;
  const SelectionArgs args = dims.selection;
  check_selection_values(lengths, start_positions, keys);

  const int64_t width = args.width();
  auto int_options = scores.options().dtype(at::kInt);
  at::Tensor indices = new_output({batch, heads, rows, width}, int_options);
  at::Tensor counts = new_output({batch, heads, rows}, int_options);
  const int64_t row_count = counts.numel();
  if (row_count == 0) return {indices, counts};

  const SequenceParameters sequences(lengths, start_positions, budgets, keys, args);
  int32_t* index_data = indices.data_ptr<int32_t>();
  int32_t* count_data = counts.data_ptr<int32_t>();

  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "topk_from_scores_cpu", [&] {
    using value_t = compare_t<scalar_t>;
    const scalar_t* data = scores.data_ptr<scalar_t>();
    const int64_t s0 = scores.stride(0), s1 = scores.stride(1), s2 = scores.stride(2), s3 = scores.stride(3);
    at::parallel_for(0, row_count, 1, [&](int64_t begin, int64_t end) {
      std::vector<int32_t> order;
      std::vector<value_t> values;
      for (int64_t row = begin; row < end; ++row) {
        const int64_t l = row % rows;
        const int64_t h = (row / rows) % heads;
        const int64_t b = row / (rows * heads);
        const RowWindow w = sequences.window(b, l, rows);
        const scalar_t* row_scores = data + b * s0 + h * s1 + l * s2;
        count_data[row] = write_selection_row(index_data + row * width, width, w, [&](int32_t* out) {
          const int64_t n = w.candidates();
          order.resize(n);
          values.resize(n);
          for (int64_t i = 0; i < n; ++i) {
            order[i] = static_cast<int32_t>(i);
            values[i] = static_cast<value_t>(row_scores[(w.sink_end + i) * s3]);
          }
          auto better = [&](int32_t a, int32_t c) {
            const value_t va = values[a], vc = values[c];
            const bool na = is_nan(va), nc = is_nan(vc);
            if (na != nc) return nc;             // a number beats a NaN
            if (!na && va != vc) return va > vc;  // higher score first
            return a > c;                         // ties: later position first
          };
          std::nth_element(order.begin(), order.begin() + w.heavy_budget, order.end(), better);
          std::sort(order.begin(), order.begin() + w.heavy_budget);
          for (int64_t i = 0; i < w.heavy_budget; ++i) *out++ = static_cast<int32_t>(w.sink_end + order[i]);
          return out;
        });
      }
    });
  });
  return {indices, counts};
}

TORCH_LIBRARY_IMPL(hashattention, CPU, m) { m.impl("topk_from_scores", &topk_from_scores_cpu); }

}  // namespace hashattention
