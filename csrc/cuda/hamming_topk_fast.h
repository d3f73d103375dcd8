// The chunked counting fast path of the CUDA hamming_topk (hamming_topk_fast.cu). CUDA sources only.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "cuda_common.cuh"
#include "message_text.h"
#include "selection_sources.cuh"

namespace hashattention {
namespace cuda {

// Selects for every one of the `row_count` rows of `p` (B * Hs * L) when its scores take at
// most `bins` values (32 * W * group + 1 <= 2049); `like` gives the device for the workspace.
void launch_hamming_topk_fast(const SelectionParams& p, const HammingSource& src, int64_t row_count, int bins,
                              const at::Tensor& like);

}  // namespace cuda
}  // namespace hashattention
