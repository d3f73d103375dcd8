// Pieces of the few-rows encoder shared by its two kernels: the problem descriptors the host fills,
// the activations, and the sm_90 bulk copies that stage a head's weights (encode_fused.cu: the
// general kernel in float32 FMAs; encode_mma.cu: bfloat16 weights on tensor cores).
#pragma once

#include <cstdint>

#include "programmatic_launch.cuh"

namespace hashattention {
namespace cuda {
namespace encode {

constexpr int kMaxLayers = 8;

enum Activation : int { kSilu = 0, kRelu = 1, kGelu = 2, kTanh = 3, kIdentity = 4 };

struct FusedMlpParams {
  const void* x;
  int64_t xs0, xs1, xs2, xs3;  // strides of x (B, H, N, D), any layout
  int64_t tokens, rows;         // N and B * N
  int layers;
  int widths[kMaxLayers + 1];  // widths[0] = D, widths[i + 1] = out_features of layer i
  // Per layer, computed on the host so that no thread divides at run time (a 32-bit division is a
  // chain of ~20 dependent instructions, and this kernel's time is its warps' dependent chains):
  int slices[kMaxLayers];           // runs of inputs a layer narrower than the block splits into
  unsigned slice_divider[kMaxLayers];  // ceil(2^20 / out): t / out == (t * slice_divider) >> 20 for t < 1024
  int full_run[kMaxLayers];         // a run's length when the whole layer is staged (multiple of 4)
  const void* weights[kMaxLayers];  // contiguous (H, in, out)
  const void* biases[kMaxLayers];   // contiguous (H, out)
  int64_t width_stride;              // floats per row in each activation buffer
  bool all_staged;                   // every layer's weights are staged together, up front
  int activation;
  // Where the signature words of row (b, head h, token n) go: out + b * os0 + h * os1 + slot * os2,
  // words contiguous, with slot = n, or positions[n] when positions is set (a cache's slots, as
  // encode_signatures_pair_into writes them; a slot outside [0, slots) is not written).
  int32_t* out;
  int64_t os0, os1, os2;
  const int64_t* positions;
  int64_t slots;
  int64_t heads;             // H, the MLP heads
  int64_t heads_per_x_head;  // MLP head h reads x head h / heads_per_x_head (x has H / heads_per_x_head heads)
};

// One launch: problems[0] gets blocks x in [0, first_heads), problems[1] (if any) the rest. Both
// share x_t, w_t and kRows (the row count of the larger problem picks kRows).
struct FusedMlpLaunch {
  FusedMlpParams problems[2];
  int64_t first_heads;
};

// The first output word of row (b, h, n), or nullptr when the row's cache slot is out of range.
__device__ __forceinline__ int32_t* signature_row(const FusedMlpParams& p, int64_t b, int64_t h, int64_t n) {
  int64_t slot = n;
  if (p.positions != nullptr) {
    slot = p.positions[n];
    if (slot < 0 || slot >= p.slots) return nullptr;
  }
  return p.out + b * p.os0 + h * p.os1 + slot * p.os2;
}

__device__ __forceinline__ float activate(float v, int activation) {
  switch (activation) {
    case kSilu: return v / (1.0f + expf(-v));
    case kRelu: return v < 0.0f ? 0.0f : v;  // NaN stays NaN, as in at::relu (its signature bits are 0)
    case kGelu: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));  // exact (erf) GELU, as at::gelu
    case kTanh: return tanhf(v);
    default: return v;
  }
}

// Bulk copies (sm_90 TMA): one instruction moves a contiguous block from global to shared memory
// and counts its bytes on an mbarrier. One thread issues two per layer (weights, bias) where 256
// threads issued 4,600 16-byte cp.async and the bias loads: fewer instructions ahead of the first
// layer (benchmarks/encoder.py, B = 1: 9.3 -> 8.5 us per pair launch, H200).
__device__ __forceinline__ unsigned shared_address(const void* pointer) {
  return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ void bulk_copy_begin(uint64_t* barrier, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(shared_address(barrier)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* barrier) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   shared_address(dst)),
               "l"(src), "r"(bytes), "r"(shared_address(barrier))
               : "memory");
#endif
}

__device__ __forceinline__ void bulk_copy_wait(uint64_t* barrier) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_FOR_BYTES:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
      "@!done bra WAIT_FOR_BYTES;\n"
      "}\n" ::"r"(shared_address(barrier))
      : "memory");
#endif
}

// Asks L2 for head h's weights and biases (every layer; `element_bytes` each), 128-byte lines spread
// over the block's `threads` threads. The kernels call it before wait_for_prerequisite_grids: launched
// programmatically they may run while the kernel before them finishes, and the weights' DRAM round
// trip then overlaps that kernel's tail. Only a prefetch may go before the wait -- the weights are
// read after it, from L2, the point of coherence, so a kernel just before that rewrote them (an
// optimizer step) is never read stale.
__device__ __forceinline__ void prefetch_weights_to_l2(const FusedMlpParams& p, int64_t h, int element_bytes,
                                                       int threads) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const auto prefetch = [&](const void* begin, int64_t bytes) {
    const uintptr_t first = reinterpret_cast<uintptr_t>(begin) & ~uintptr_t(127);
    const uintptr_t end = reinterpret_cast<uintptr_t>(begin) + static_cast<uintptr_t>(bytes);
    for (uintptr_t line = first + uintptr_t(threadIdx.x) * 128; line < end; line += uintptr_t(threads) * 128) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
    }
  };
  for (int layer = 0; layer < p.layers; ++layer) {
    const int64_t fan_in = p.widths[layer], fan_out = p.widths[layer + 1];
    prefetch(static_cast<const char*>(p.weights[layer]) + h * fan_in * fan_out * element_bytes,
             fan_in * fan_out * element_bytes);
    prefetch(static_cast<const char*>(p.biases[layer]) + h * fan_out * element_bytes, fan_out * element_bytes);
  }
#endif
}

// 16 bytes global -> shared without passing through registers (sm_80+); completes at
// copy_async_wait_all. `.cg`: cached in L2 only (each block reads its head's weights once).
__device__ __forceinline__ void copy_async_16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(src) : "memory");
#else  // older architectures (TORCH_CUDA_ARCH_LIST below 8.0): a plain copy
  *static_cast<uint4*>(dst) = __ldg(static_cast<const uint4*>(src));
#endif
}

__device__ __forceinline__ void copy_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

}  // namespace encode
}  // namespace cuda
}  // namespace hashattention
