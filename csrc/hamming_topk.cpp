// CPU kernel of `hamming_topk`: Hamming scoring fused with exact top-k selection.
//
// A row's scores take only max_score + 1 integer values, so the exact top-m is found by
// counting instead of sorting: histogram the candidates' scores, take the threshold T as the
// largest score with count(score >= T) >= m, then emit every candidate above T plus the
// *last* (m - count(score > T)) candidates equal to T, in position order. That is exact,
// deterministic (ties go to later positions) and already position-sorted.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "checks.h"
#include "outputs.h"
#include "hamming_common.h"
#include "selection_cpu.h"

namespace hashattention {

std::tuple<at::Tensor, at::Tensor> hamming_topk_cpu(const at::Tensor& query_signatures,
                                                    const at::Tensor& key_signatures,
                                                    const std::optional<at::Tensor>& lengths,
                                                    const std::optional<at::Tensor>& start_positions,
                                                    const std::optional<at::Tensor>& budgets,
                                                    int64_t selection_heads, int64_t sink_tokens,
                                                    int64_t local_tokens, int64_t budget_tokens) {
  const HammingDims dims = check_hamming_args(query_signatures, key_signatures, selection_heads);
  const SelectionArgs args =
      check_selection_args(lengths, start_positions, budgets, dims.batch, query_signatures, "query_signatures",
                           dims.keys, "key_signatures", sink_tokens, local_tokens, budget_tokens);
  check_selection_values(lengths, start_positions, dims.keys);

  const int64_t width = args.width();
  auto int_options = query_signatures.options().dtype(at::kInt);
  at::Tensor indices = new_output({dims.batch, dims.selection_heads, dims.rows, width}, int_options);
  at::Tensor counts = new_output({dims.batch, dims.selection_heads, dims.rows}, int_options);
  const int64_t row_count = counts.numel();
  if (row_count == 0) return {indices, counts};

  const SequenceParameters sequences(lengths, start_positions, budgets, dims.keys, args);
  const SignatureView q(query_signatures), k(key_signatures);
  int32_t* index_data = indices.data_ptr<int32_t>();
  int32_t* count_data = counts.data_ptr<int32_t>();
  const int64_t max_score = dims.max_score();

  at::parallel_for(0, row_count, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> scores;
    std::vector<int64_t> histogram(max_score + 1);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t l = row % dims.rows;
      const int64_t s = (row / dims.rows) % dims.selection_heads;
      const int64_t b = row / (dims.rows * dims.selection_heads);
      const RowWindow w = sequences.window(b, l, dims.rows);
      count_data[row] = write_selection_row(index_data + row * width, width, w, [&](int32_t* out) {
        const int64_t n = w.candidates();
        scores.resize(n);
        std::fill(histogram.begin(), histogram.end(), 0);
        for (int64_t i = 0; i < n; ++i) {
          scores[i] = hamming_similarity_cpu(dims, q, k, b, s, l, w.sink_end + i);
          ++histogram[scores[i]];
        }
        int64_t threshold = max_score, at_or_above = histogram[max_score];
        while (at_or_above < w.heavy_budget) at_or_above += histogram[--threshold];
        const int64_t above = at_or_above - histogram[threshold];
        // Ties at the threshold: keep the last (budget - above) of them by position.
        int64_t ties_to_skip = histogram[threshold] - (w.heavy_budget - above);
        for (int64_t i = 0; i < n; ++i) {
          if (scores[i] > threshold) {
            *out++ = static_cast<int32_t>(w.sink_end + i);
          } else if (scores[i] == threshold) {
            if (ties_to_skip > 0) {
              --ties_to_skip;
            } else {
              *out++ = static_cast<int32_t>(w.sink_end + i);
            }
          }
        }
        return out;
      });
    }
  });
  return {indices, counts};
}

TORCH_LIBRARY_IMPL(hashattention, CPU, m) { m.impl("hamming_topk", &hamming_topk_cpu); }

}  // namespace hashattention
