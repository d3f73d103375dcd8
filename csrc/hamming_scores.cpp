// CPU kernel of `hamming_scores`: the full (B, Hs, L, N) similarity tensor, for research and
// evaluation (the decode path uses the fused `hamming_topk` instead and never writes it).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "hamming_common.h"
#include "outputs.h"

namespace hashattention {

at::Tensor hamming_scores_cpu(const at::Tensor& query_signatures, const at::Tensor& key_signatures,
                              int64_t selection_heads) {
  const HammingDims dims = check_hamming_args(query_signatures, key_signatures, selection_heads);
  at::Tensor out = new_output({dims.batch, dims.selection_heads, dims.rows, dims.keys},
                             query_signatures.options().dtype(at::kInt));
  const int64_t total = out.numel();
  if (total == 0) return out;
  const SignatureView q(query_signatures), k(key_signatures);
  int32_t* dst = out.data_ptr<int32_t>();
  at::parallel_for(0, total, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i % dims.keys;
      const int64_t row = i / dims.keys;
      const int64_t l = row % dims.rows;
      const int64_t s = (row / dims.rows) % dims.selection_heads;
      const int64_t b = row / (dims.rows * dims.selection_heads);
      dst[i] = hamming_similarity_cpu(dims, q, k, b, s, l, n);
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(hashattention, CPU, m) { m.impl("hamming_scores", &hamming_scores_cpu); }

}  // namespace hashattention
