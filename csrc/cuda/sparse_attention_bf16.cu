// Instantiations of the sparse attention kernel for c10::BFloat16 (one file per dtype keeps the
// compile parallel and each translation unit small).
#include "sparse_attention_kernel.cuh"

namespace hashattention {
namespace cuda {

template <>
AttentionKernel attention_kernel<c10::BFloat16>(int head_dim, int max_heads) {
  return select_attention_kernel<c10::BFloat16>(head_dim, max_heads);
}

}  // namespace cuda
}  // namespace hashattention
