// L2 prefetch of a key-signature cache by the decode step's encoder launch.
//
// A decode step runs, per layer: the encoder (encode_signatures_pair_into: the new query and key
// rows' signatures, the key's written into the cache), then the selection, which reads every
// cached key signature of the layer (B = 4, 32 heads, 128K positions: 67 MB) and is bound by that
// read (H200: 20 of its 30 us). The encoder is latency-bound -- a few MB of weights, ~10 us -- so
// DRAM is nearly idle while it runs. Its launch therefore also asks L2 for the cache rows the
// selection will read (cp.async.bulk.prefetch.L2: one instruction per granule, no registers, no
// completion to wait for), and the selection then finds part of its bytes in L2.
//
// How much: all of it when it fits the budget (default: half the device's L2, so that the rest
// of L2 keeps what the selection and the encoder need), else the same leading share of every
// granule of every row, so that every selection block gets the same share of hits. The rows'
// extent is [0, max(positions) + 1): the slots written so far, read from the positions the
// encoder writes (a static cache of 128K slots holding 2K tokens prefetches 2K, not 128K).
// A prefetch is a hint: it changes no result, and a stale line cannot be read through it (L2 is
// the point of coherence). HASHATTENTION_SIGNATURE_PREFETCH_BYTES (a timing aid, bytes; 0: off)
// replaces the budget; HASHATTENTION_SIGNATURE_PREFETCH_EVICT_LAST=1 marks the lines evict-last.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <cstdint>
#include <cstdlib>

#include "int_math.cuh"

namespace hashattention {
namespace cuda {

struct SignaturePrefetch {
  const char* base = nullptr;  // the cache (B, H, S, W) int32; nullptr: no prefetch
  int64_t batch = 0, heads = 0;
  int64_t batch_stride = 0, head_stride = 0, slot_bytes = 0;  // bytes
  int64_t slot_used_bytes = 0;  // bytes of one slot's words (slot_bytes with padding past them)
  int64_t slots = 0;                                          // S
  const int64_t* positions = nullptr;                         // the slots this launch writes (N,)
  int positions_count = 0;
  int64_t budget_bytes = 0;
  int evict_last = 0;
};

constexpr int64_t kPrefetchGranule = 16 * 1024;  // bytes a bulk prefetch covers at most
constexpr int kMaxPrefetchPositions = 64;         // the few-rows encoder's row limit

// Reads an integer environment override in [0, 2^40], or returns `fallback`.
inline int64_t prefetch_setting(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  TORCH_CHECK(end != value && *end == '\0' && parsed >= 0 && parsed <= (1ll << 40), name,
              " must be an integer in [0, 2^40] (a timing aid), got '", value, "'");
  return parsed;
}

// The prefetch of `cache` (B, H, S, W) int32 with contiguous words, whose slots `positions`
// (int64 (N,)) this launch writes; off (base nullptr) without positions or with more than
// kMaxPrefetchPositions of them (prefill chunks: the selection does not follow each one).
inline SignaturePrefetch describe_signature_prefetch(const at::Tensor& cache, const at::Tensor& positions) {
  SignaturePrefetch p;
  if (!positions.defined() || positions.numel() == 0 || positions.numel() > kMaxPrefetchPositions ||
      cache.dim() != 4 || cache.numel() == 0) {
    return p;
  }
  // Only layouts whose (b, h) rows are disjoint ranges of memory (the HF static cache, padded or
  // not); a slot-major cache interleaves its heads' rows, and the ranges would overlap.
  const auto disjoint = [&](int dim, int64_t span) { return cache.size(dim) == 1 || cache.stride(dim) >= span; };
  const int64_t row_span = (cache.size(2) - 1) * cache.stride(2) + cache.size(3);
  if (cache.stride(3) != 1 || !disjoint(2, cache.size(3)) || !disjoint(1, row_span) ||
      !disjoint(0, (cache.size(1) - 1) * cache.stride(1) + row_span)) {
    return p;
  }
  const int64_t l2 = at::cuda::getCurrentDeviceProperties()->l2CacheSize;
  p.budget_bytes = prefetch_setting("HASHATTENTION_SIGNATURE_PREFETCH_BYTES", l2 / 2);
  if (p.budget_bytes < 16) return p;
  p.evict_last = prefetch_setting("HASHATTENTION_SIGNATURE_PREFETCH_EVICT_LAST", 0) != 0;
  p.base = static_cast<const char*>(cache.data_ptr());
  p.batch = cache.size(0), p.heads = cache.size(1), p.slots = cache.size(2);
  const int64_t element = cache.element_size();
  p.batch_stride = cache.stride(0) * element, p.head_stride = cache.stride(1) * element;
  p.slot_bytes = cache.stride(2) * element;
  p.slot_used_bytes = cache.size(3) * element;
  p.positions = positions.data_ptr<int64_t>();
  p.positions_count = static_cast<int>(positions.numel());
  return p;
}

// Issues this block's share of the prefetch with the 32 lanes of one warp (`lane`), as block
// `block` of `blocks`: granule g of the (row, granule) grid goes to block g % blocks. Call after
// wait_for_prerequisite_grids (the positions may come from the kernel before).
__device__ __forceinline__ void prefetch_signature_rows(const SignaturePrefetch& p, int lane, int64_t block,
                                                        int64_t blocks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.base == nullptr) return;
  int64_t last = -1;  // the highest slot written
  for (int i = lane; i < p.positions_count; i += 32) last = max64(last, p.positions[i]);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) last = max64(last, __shfl_xor_sync(0xffffffffu, last, offset));
  const int64_t used = min64(last + 1, p.slots);
  if (used <= 0) return;
  const int64_t row_bytes = (used - 1) * p.slot_bytes + p.slot_used_bytes;  // ends at the last used word
  const int64_t granules_per_row = (row_bytes + kPrefetchGranule - 1) / kPrefetchGranule;
  const int64_t rows = p.batch * p.heads, total = rows * row_bytes;
  // The leading share of each granule that keeps the total within the budget (16-byte multiples).
  const int64_t share = total <= p.budget_bytes ? kPrefetchGranule
                                                : (kPrefetchGranule * p.budget_bytes / total) & ~int64_t(15);
  if (share < 16) return;
  uint64_t policy = 0;
  if (p.evict_last) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  for (int64_t g = block + int64_t(lane) * blocks; g < rows * granules_per_row; g += 32 * blocks) {
    const int64_t row = g / granules_per_row, offset = (g - row * granules_per_row) * kPrefetchGranule;
    const int64_t b = row / p.heads, h = row - b * p.heads;
    const uintptr_t row_start = reinterpret_cast<uintptr_t>(p.base + b * p.batch_stride + h * p.head_stride);
    // Whole 16-byte units inside the row's used bytes only: nothing past the cache is touched.
    const uintptr_t first = (row_start + offset + 15) & ~uintptr_t(15);
    const uintptr_t stop = row_start + static_cast<uintptr_t>(min64(offset + share, row_bytes));
    const uintptr_t end = stop & ~uintptr_t(15);
    if (end <= first) continue;
    const unsigned bytes = static_cast<unsigned>(end - first);
    if (p.evict_last) {
      asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(first), "r"(bytes),
                   "l"(policy)
                   : "memory");
    } else {
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(first), "r"(bytes) : "memory");
    }
  }
#endif
}

}  // namespace cuda
}  // namespace hashattention
