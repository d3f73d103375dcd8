// The one-launch ("resident") path of the CUDA hamming_topk (hamming_topk_resident.cu). CUDA sources only.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "cuda_common.cuh"
#include "selection_sources.cuh"

namespace hashattention {
namespace cuda {

// Selects for every one of the `row_count` rows of `p` (B * Hs * L) in one cooperative launch
// when the whole problem fits on chip at once: one-word signatures read with 16-byte loads, a
// group of 1, 2 or 4 query heads per selection head, and few enough positions in all that every
// block of the grid is resident (a byte of shared memory per position: about 25M positions on an
// H200, e.g. 32 heads x 512K at batch 1). Returns false, launching
// nothing, when any of that does not hold (the caller then uses the chunked two-kernel path),
// or when the environment variable HASHATTENTION_SELECTION is "chunked" (tests and A/B runs).
bool launch_hamming_topk_resident(const SelectionParams& p, const HammingSource& src, int64_t row_count,
                                  const at::Tensor& like);

}  // namespace cuda
}  // namespace hashattention
