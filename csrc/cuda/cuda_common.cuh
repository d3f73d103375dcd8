// Small pieces shared by the CUDA kernels: launch checks, per-sequence parameters of the
// selection ops read on the device, and the ordered compaction of a top-k row by a block of kThreads threads.
//
// Device-side semantics where the CPU kernels would raise on *values* (the CUDA kernels never
// read device data on the host, so they cannot raise without a host sync):
//   * lengths are clamped to [0, N];
//   * start_positions < 0 count as 0, and a start beyond a row's position selects nothing;
//   * budgets are clamped to [0, budget_tokens];
//   * sparse_attention counts are clamped to [0, width], and index entries outside [0, keys)
//     (and block-table entries outside [0, num_pages)) are skipped like padding.
// For inputs the CPU accepts, the results are the same as the CPU kernels'.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <optional>

#include "int_math.cuh"
#include "programmatic_launch.cuh"
#include "selection_window.h"

namespace hashattention {
namespace cuda {

constexpr int kThreads = 256;  // every selection kernel runs blocks of this many threads
constexpr int kWarps = kThreads / 32;


inline int multiprocessor_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

constexpr size_t kDefaultSmem = 48 * 1024;  // dynamic shared memory a kernel gets without opting in

// Opts `kernel` in to `bytes` of dynamic shared memory when that is more than the default.
template <typename Kernel>
void allow_shared_memory(Kernel kernel, size_t bytes) {
  if (bytes > kDefaultSmem) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
}

// Launches `kernel`, whose one parameter is the struct at `params`, on the current stream, with
// programmatic stream serialization where programmatic_launch_allowed says so (the kernel then
// calls wait_for_prerequisite_grids before its first read of anything an earlier kernel wrote).
inline void launch_with_single_argument(const void* kernel, dim3 grid, dim3 block, size_t shared_bytes,
                                        void* params) {
  KernelLaunch launch(grid, block, shared_bytes, at::cuda::getCurrentCUDAStream());
  if (programmatic_launch_allowed(kernel)) launch.programmatic();
  void* args[] = {params};
  C10_CUDA_CHECK(cudaLaunchKernelExC(&launch.config, kernel, args));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// A per-sequence int32 vector (B,) on the device, or absent.
struct SequenceVector {
  const int32_t* data = nullptr;
  int64_t stride = 0;

  SequenceVector() = default;
  explicit SequenceVector(const std::optional<at::Tensor>& t)
      : data(t.has_value() ? t->data_ptr<int32_t>() : nullptr), stride(t.has_value() ? t->stride(0) : 0) {}
  __device__ __forceinline__ int64_t get(int64_t b, int64_t fallback) const {
    return data == nullptr ? fallback : static_cast<int64_t>(data[b * stride]);
  }
};

// Everything a selection kernel needs to find the window of a row and write its output.
struct SelectionParams {
  SequenceVector lengths, starts, budgets;
  int64_t keys;        // N
  int64_t sink, local, budget, width;
  int64_t heads, rows;  // selection heads, query rows per sequence
  int32_t* indices;     // (B, Hs, L, width) contiguous
  int32_t* counts;      // (B, Hs, L) contiguous

  __device__ __forceinline__ RowWindow window(int64_t b, int64_t l) const {
    int64_t length = lengths.get(b, keys);
    length = length < 0 ? 0 : (length > keys ? keys : length);
    const int64_t start = starts.get(b, 0);  // make_row_window treats start < 0 as 0
    int64_t m = budgets.get(b, budget);
    m = m < 0 ? 0 : (m > budget ? budget : m);
    return make_row_window(length, start, l, rows, sink, local, m);
  }
};

// Writes the parts of a selection row that do not depend on scores: the sink window, the
// local window (after the heavy slots), the -1 padding and the count. Block-cooperative.
__device__ __forceinline__ void write_fixed_part_of_row(const SelectionParams& p, int64_t row, const RowWindow& w) {
  int32_t* out = p.indices + row * p.width;
  const int64_t sink_count = w.sink_end - w.start;
  const int64_t local_count = w.end - w.local_begin;
  const int64_t local_offset = sink_count + w.heavy_budget;
  const int64_t count = local_offset + local_count;
  for (int64_t i = threadIdx.x; i < sink_count; i += blockDim.x) out[i] = static_cast<int32_t>(w.start + i);
  for (int64_t i = threadIdx.x; i < local_count; i += blockDim.x) {
    out[local_offset + i] = static_cast<int32_t>(w.local_begin + i);
  }
  for (int64_t i = count + threadIdx.x; i < p.width; i += blockDim.x) out[i] = -1;
  if (threadIdx.x == 0) p.counts[row] = static_cast<int32_t>(count);
}

// Writes, in position order, the elements of [0, n) that a top-k selection keeps, given
// flag(i): 2 = strictly better than the threshold, 1 = tie at the threshold, 0 = worse.
// Ties are kept from the `skip`-th on (the earlier ties lose: ties go to later positions).
// Element i goes to out[g + max(0, t - skip)] where g / t count the better elements / ties
// before it, and holds first_position + i. Block-cooperative (kThreads threads).
template <int kItems, typename Flag>
__device__ __forceinline__ void ordered_compact(int64_t n, Flag flag, int64_t skip, int32_t* out,
                                                int64_t first_position, int* table /* kItems * kWarps */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned lanes_before = (1u << lane) - 1u;
  int64_t better_run = 0, ties_run = 0;
  for (int64_t tile = 0; tile < n; tile += int64_t(kItems) * kThreads) {
    int f[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t i = tile + k * kThreads + threadIdx.x;
      f[k] = i < n ? flag(i) : 0;
    }
    unsigned better_mask[kItems], tie_mask[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      better_mask[k] = __ballot_sync(0xffffffffu, f[k] == 2);
      tie_mask[k] = __ballot_sync(0xffffffffu, f[k] == 1);
      if (lane == 0) table[k * kWarps + warp] = __popc(better_mask[k]) | (__popc(tie_mask[k]) << 16);
    }
    __syncthreads();
    // Prefix of (k, warp) over entries in element order: all warps of k' < k, then warps < warp of k.
    int prefix[kItems];
    int running = 0;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      for (int w = 0; w < kWarps; ++w) {
        if (w == warp) prefix[k] = running;
        running += table[k * kWarps + w];
      }
    }
    const int total = running;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      if (f[k] != 0) {
        const int64_t i = tile + k * kThreads + threadIdx.x;
        const int64_t better_before = better_run + (prefix[k] & 0xffff) + __popc(better_mask[k] & lanes_before);
        const int64_t ties_before = ties_run + (prefix[k] >> 16) + __popc(tie_mask[k] & lanes_before);
        if (f[k] == 2 || ties_before >= skip) {
          const int64_t kept_ties = ties_before > skip ? ties_before - skip : 0;
          out[better_before + kept_ties] = static_cast<int32_t>(first_position + i);
        }
      }
    }
    better_run += total & 0xffff;
    ties_run += total >> 16;
    __syncthreads();  // table is rewritten by the next tile
  }
}

}  // namespace cuda
}  // namespace hashattention
