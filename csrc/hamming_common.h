// Addressing of signature tensors and the Hamming similarity of one (row, key) pair,
// shared by the scoring and the fused top-k kernels.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "op_arguments.h"
#include "selection_window.h"

namespace hashattention {

// Raw view of a (batch, heads, tokens, words) int32 tensor whose last dimension is contiguous.
struct SignatureView {
  const int32_t* data;
  int64_t stride_batch, stride_head, stride_token;

  explicit SignatureView(const at::Tensor& t)
      : data(t.data_ptr<int32_t>()), stride_batch(t.stride(0)), stride_head(t.stride(1)),
        stride_token(t.stride(2)) {}

  HA_HOST_DEVICE const int32_t* row(int64_t b, int64_t h, int64_t n) const {
    return data + b * stride_batch + h * stride_head + n * stride_token;
  }
};

// Similarity of key `n` for selection head `s` of batch `b`: bits - popcount(q ^ k), summed over
// words and over the query heads that share selection head `s`.
inline int32_t hamming_similarity_cpu(const HammingDims& dims, const SignatureView& q, const SignatureView& k,
                                      int64_t b, int64_t s, int64_t l, int64_t n) {
  const int64_t group = dims.heads_per_selection();
  const int64_t per_key = dims.query_heads_per_key_head();
  int32_t score = 0;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = s * group + g;
    const int32_t* qr = q.row(b, h, l);
    const int32_t* kr = k.row(b, h / per_key, n);
    int32_t distance = 0;
    for (int64_t w = 0; w < dims.words; ++w) {
      distance += __builtin_popcount(static_cast<uint32_t>(qr[w] ^ kr[w]));
    }
    score += static_cast<int32_t>(32 * dims.words) - distance;
  }
  return score;
}

}  // namespace hashattention
