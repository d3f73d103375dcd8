// 64-bit integer min/max usable on host and device (CUDA's min/max overloads are not
// templates, and std::min is host-only without --expt-relaxed-constexpr everywhere).
#pragma once

#include <cstdint>

namespace hashattention {
namespace cuda {

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

}  // namespace cuda
}  // namespace hashattention
