// The head mapping of encode_signatures_pair's key: key (B, Hx, N, D) feeds an MLP stack of
// H heads (Hx divides H), MLP head h reading key head h / (H / Hx) -- KV-head keys for
// per-query-head MLPs, with no repeated copy in the fused CUDA kernel. The paths that take one
// x head per MLP head (the CPU kernel, the cuBLAS path) get that copy from here.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace hashattention {

// x (B, Hx, N, D) -> (B, heads, N, D) with head h = x head h / (heads / Hx); x itself when
// Hx == heads. Arguments as validated by check_encode_pair_args.
inline at::Tensor repeat_x_heads(const at::Tensor& x, int64_t heads) {
  const int64_t x_heads = x.size(1);
  if (x_heads == heads) return x;
  const int64_t group = heads / x_heads;
  return x.unsqueeze(2)
      .expand({x.size(0), x_heads, group, x.size(2), x.size(3)})
      .reshape({x.size(0), heads, x.size(2), x.size(3)});
}

}  // namespace hashattention
