// Instantiations of the sparse attention kernel for c10::BFloat16 (one file per dtype keeps the
// compile parallel and each translation unit small).
#include "sparse_attention_kernel.cuh"

namespace hashattention {
namespace cuda {

template <>
void launch_sparse_attention<c10::BFloat16>(const AttentionParams& params, int head_dim, int max_heads, dim3 grid,
                                  cudaStream_t stream) {
#define HA_LAUNCH(D, H)                                                                              \
  if (head_dim == D && max_heads == H) {                                                             \
    sparse_attention_kernel<c10::BFloat16, D, H><<<grid, kAttentionThreads, 0, stream>>>(params);    \
    return;                                                                                          \
  }
  HA_LAUNCH(64, 1) HA_LAUNCH(64, 4) HA_LAUNCH(64, 8)
  HA_LAUNCH(128, 1) HA_LAUNCH(128, 4) HA_LAUNCH(128, 8)
  HA_LAUNCH(256, 1) HA_LAUNCH(256, 4) HA_LAUNCH(256, 8)
#undef HA_LAUNCH
}

}  // namespace cuda
}  // namespace hashattention
