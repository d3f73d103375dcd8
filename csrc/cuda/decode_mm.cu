// decode_mm on CUDA: a @ b for the few rows of a decode step (M <= 8) against a weight stored the way
// frozen nn.Linear weights reach inductor's GEMMs (b = weight.t(), column-major), bf16 / fp16.
//
// Why not cuBLAS: at M = 1-4 a decode step's GEMMs are weight reads. cuBLAS moves Llama-3.1-8B's 15 GB of
// weights at ~3.3 TB/s on an H200 (docs/end-to-end.md: 4.4-4.5 ms per step, 0.26 ms of it split-K
// reduction launches), ~80% of the copy bandwidth, and its kernels cannot start reading before the
// kernel ahead of them ends. Here every warp streams whole weight rows with 16-byte loads, several in
// flight, the few input rows come from L1, no reduction launch follows, and a block launched
// programmatically loads its first weight chunks (constants: nothing earlier writes them) before it
// waits for the kernel that wrote its input.
//
// Layout of the work: out[m, n] = sum_k a[m, k] * w[n, k] with w = b.t() row-major (N, K). A warp takes
// groups of kRows consecutive n in turn (a grid the GPU holds at once, striding over the groups) and
// walks K in 8-element chunks, lane c taking chunks c, c + 32, ...; each chunk of a is read once per
// warp and used for all kRows rows. Partial sums stay in fp32 registers and are reduced across the warp
// at the end, so no second launch adds up partial products (cuBLAS's split-K does).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "decode_mm.h"
#include "cuda_common.cuh"
#include "outputs.h"

namespace hashattention {
namespace cuda {
namespace {

constexpr int kMmWarps = 4;  // warps per block
constexpr int kMmUnroll = 4;  // chunks per lane per stage: kRows * kMmUnroll 16-byte loads in flight

template <typename T>
struct DecodeMmParams {
  const T* a;         // (rows, K), row stride a_stride
  const T* w;         // (N, K), row stride w_stride: b.t()
  T* out;             // (rows, N) contiguous
  int64_t a_stride, w_stride, K, N;
  int rows;           // M, 1..kMaxRows
};

__device__ __forceinline__ uint4 load_streaming(const void* p) {
  // The weights are read once per step: keep them out of L1, where the input rows live.
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ float2 to_float2(uint32_t bits, const __nv_bfloat16*) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
}
__device__ __forceinline__ float2 to_float2(uint32_t bits, const __half*) {
  return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}

__device__ __forceinline__ __nv_bfloat16 from_float(float x, const __nv_bfloat16*) { return __float2bfloat16(x); }
__device__ __forceinline__ __half from_float(float x, const __half*) { return __float2half(x); }

// acc += dot(8 values of a, 8 values of w), in fp32.
template <typename T>
__device__ __forceinline__ float dot8(const uint4& a, const uint4& w, float acc) {
  const uint32_t av[4] = {a.x, a.y, a.z, a.w};
  const uint32_t wv[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = to_float2(av[i], static_cast<const T*>(nullptr));
    const float2 y = to_float2(wv[i], static_cast<const T*>(nullptr));
    acc = fmaf(x.x, y.x, acc);
    acc = fmaf(x.y, y.y, acc);
  }
  return acc;
}

// One warp's rows [first_n, first_n + kRows) (clipped to N): out[m, n] for every m < rows.
template <typename T, int kMaxRows, int kRows>
__device__ __forceinline__ void rows_of_one_warp(const DecodeMmParams<T>& p, int64_t first_n, int lane, bool first) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const char* w_rows[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    // Rows past N repeat the last row (valid memory); their sums are never stored.
    const int64_t n = first_n + r < p.N ? first_n + r : p.N - 1;
    w_rows[r] = reinterpret_cast<const char*>(p.w + n * p.w_stride);
  }
  const int64_t chunks = p.K / 8;
  constexpr int64_t kStage = 32 * kMmUnroll;  // chunks per warp per stage

  uint4 next[kMmUnroll][kRows];
  auto load_stage = [&](int64_t base) {
#pragma unroll
    for (int u = 0; u < kMmUnroll; ++u) {
      const int64_t c = base + u * 32 + lane;
#pragma unroll
      for (int r = 0; r < kRows; ++r) next[u][r] = c < chunks ? load_streaming(w_rows[r] + c * 16) : zero;
    }
  };
  load_stage(0);
  if (first) {
    // The weights are constants: the first stage streams in while the kernel that wrote `a` finishes.
    wait_for_prerequisite_grids();
    allow_dependent_launch();
  }

  float acc[kMaxRows][kRows];
#pragma unroll
  for (int m = 0; m < kMaxRows; ++m)
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[m][r] = 0.f;

  for (int64_t base = 0; base < chunks; base += kStage) {
    uint4 current[kMmUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kMmUnroll; ++u)
#pragma unroll
      for (int r = 0; r < kRows; ++r) current[u][r] = next[u][r];
    if (base + kStage < chunks) load_stage(base + kStage);
#pragma unroll
    for (int u = 0; u < kMmUnroll; ++u) {
      const int64_t c = base + u * 32 + lane;
      if (c >= chunks) break;
#pragma unroll
      for (int m = 0; m < kMaxRows; ++m) {
        if (m >= p.rows) break;
        const uint4 x = __ldg(reinterpret_cast<const uint4*>(p.a + m * p.a_stride) + c);
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[m][r] = dot8<T>(x, current[u][r], acc[m][r]);
      }
    }
  }

#pragma unroll
  for (int m = 0; m < kMaxRows; ++m) {
    if (m >= p.rows) break;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float s = acc[m][r];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
      if (lane == ((m * kRows + r) & 31) && first_n + r < p.N) {
        p.out[m * p.N + first_n + r] = from_float(s, static_cast<const T*>(nullptr));
      }
    }
  }
}

// Warps stride over groups of kRows rows: the grid is at most what the GPU holds at once, so every warp
// does nearly the same number of groups (launch_for_rows picks kRows for that).
template <typename T, int kMaxRows, int kRows>
__global__ void __launch_bounds__(kMmWarps * 32) decode_mm_kernel(const DecodeMmParams<T> p) {
  const int lane = threadIdx.x & 31;
  const int64_t groups = (p.N + kRows - 1) / kRows;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kMmWarps;
  int64_t group = static_cast<int64_t>(blockIdx.x) * kMmWarps + (threadIdx.x >> 5);
  if (group >= groups) {
    wait_for_prerequisite_grids();
    return;
  }
  for (bool first = true; group < groups; group += warps, first = false) {
    rows_of_one_warp<T, kMaxRows, kRows>(p, group * kRows, lane, first);
  }
}

// Blocks of `kernel` one SM holds at once, asked from the driver once per (device, kernel).
int64_t resident_blocks_per_sm(const void* kernel) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, int> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, kernel);
  auto it = cache.find(key);
  if (it == cache.end()) {
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kMmWarps * 32, 0));
    it = cache.emplace(key, std::max(blocks, 1)).first;
  }
  return it->second;
}

// Rows per warp: the one whose groups fill the resident warps' rounds best (a weight row is the unit of
// work, and a round in which only some warps have a row left streams at a fraction of the bandwidth);
// more rows per warp on a tie, which reads the input rows from L1 fewer times per weight byte.
template <typename T, int kMaxRows>
void launch_for_rows(const DecodeMmParams<T>& p) {
  const void* kernels[] = {reinterpret_cast<const void*>(&decode_mm_kernel<T, kMaxRows, 4>),
                           reinterpret_cast<const void*>(&decode_mm_kernel<T, kMaxRows, 2>),
                           reinterpret_cast<const void*>(&decode_mm_kernel<T, kMaxRows, 1>)};
  const int64_t rows_per_warp[] = {4, 2, 1};
  const int64_t sms = multiprocessor_count();
  int best = 0;
  double best_fill = -1.0;
  int64_t best_blocks = 1;
  for (int i = 0; i < 3; ++i) {
    const int64_t groups = (p.N + rows_per_warp[i] - 1) / rows_per_warp[i];
    const int64_t resident_warps = resident_blocks_per_sm(kernels[i]) * sms * kMmWarps;
    const int64_t rounds = (groups + resident_warps - 1) / resident_warps;
    const double fill = static_cast<double>(groups) / static_cast<double>(rounds * resident_warps);
    if (fill > best_fill + 0.05) {
      best = i;
      best_fill = fill;
      best_blocks = std::min((groups + kMmWarps - 1) / kMmWarps, resident_warps / kMmWarps);
    }
  }
  DecodeMmParams<T> params = p;
  launch_with_single_argument(kernels[best], dim3(static_cast<unsigned>(best_blocks)), dim3(kMmWarps * 32), 0,
                              &params);
}

template <typename T>
void launch_decode_mm(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  DecodeMmParams<T> p;
  p.a = reinterpret_cast<const T*>(a.data_ptr());
  p.w = reinterpret_cast<const T*>(b.data_ptr());
  p.out = reinterpret_cast<T*>(out.data_ptr());
  p.a_stride = a.stride(0);
  p.w_stride = b.stride(1);
  p.K = a.size(1);
  p.N = b.size(1);
  p.rows = static_cast<int>(a.size(0));
  if (p.rows <= 1) return launch_for_rows<T, 1>(p);
  if (p.rows <= 2) return launch_for_rows<T, 2>(p);
  if (p.rows <= 4) return launch_for_rows<T, 4>(p);
  return launch_for_rows<T, kDecodeMmMaxRows>(p);
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

}  // namespace

bool decode_mm_fast_path(const at::Tensor& a, const at::Tensor& b) {
  const auto dtype = a.scalar_type();
  if (dtype != b.scalar_type() || (dtype != at::kBFloat16 && dtype != at::kHalf)) return false;
  const int64_t rows = a.size(0), K = a.size(1), N = b.size(1);
  if (rows < 1 || rows > kDecodeMmMaxRows || K < 8 || K % 8 != 0 || N < 1) return false;
  // a row-major with 16-byte aligned rows; b column-major (its transpose row-major) likewise.
  if (a.stride(1) != 1 || a.stride(0) % 8 != 0 || !aligned16(a)) return false;
  if (b.stride(0) != 1 || b.stride(1) % 8 != 0 || b.stride(1) < K || !aligned16(b)) return false;
  return true;
}

at::Tensor decode_mm_cuda(const at::Tensor& a, const at::Tensor& b) {
  check_decode_mm_arguments(a, b);
  if (!decode_mm_fast_path(a, b)) return at::mm(a, b);
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = new_output({a.size(0), b.size(1)}, a.options());
  if (a.scalar_type() == at::kBFloat16) {
    launch_decode_mm<__nv_bfloat16>(a, b, out);
  } else {
    launch_decode_mm<__half>(a, b, out);
  }
  return out;
}

}  // namespace cuda

TORCH_LIBRARY_IMPL(hashattention, CUDA, m) { m.impl("decode_mm", &cuda::decode_mm_cuda); }

}  // namespace hashattention
