// The one-launch ("resident") path of the CUDA hamming_topk (hamming_topk_resident.cu). CUDA sources only.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "cuda_common.cuh"
#include "selection_sources.cuh"

namespace hashattention {
namespace cuda {

// Selects for every one of the `row_count` rows of `p` (B * Hs * L) with one-word signatures read
// with 16-byte loads and a group of 1, 2 or 4 query heads per selection head: in one cooperative
// launch when every block of the grid can be resident at once (a byte of shared memory per
// position: about 25M positions on an H200, e.g. 32 heads x 512K at batch 1), else in grid slices
// of whole batches (or of one batch's head rows) launched one after another, each resident.
// Returns false, launching nothing, when the signatures do not have that form or one row alone
// does not fit (the caller then uses the chunked two-kernel path), or when the environment
// variable HASHATTENTION_SELECTION is "chunked" (tests and A/B runs).
bool launch_hamming_topk_resident(const SelectionParams& p, const HammingSource& src, int64_t row_count,
                                  const at::Tensor& like);

}  // namespace cuda
}  // namespace hashattention
