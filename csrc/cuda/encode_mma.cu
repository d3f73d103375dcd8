// The few-rows encoder on tensor cores, for bfloat16 weights (every decode step of a bf16 model).
//
// The float32 kernel (encode_fused.cu) computes each output unit as a chain of FMAs over its
// inputs; its time was that chain, not bytes (Nsight Compute, B = 1: ~2,000 instructions per warp
// at IPC ~1; 7.5 us per pair launch at B = 1 and 10.4 at B = 4, where one block per head and row
// re-stages the head's weights: benchmarks/encoder.py, H200). Here one block takes every row of
// one head (up to 16: one m16 tile) and each warp computes 16-column slices of a layer with
// mma.sync m16n8k16 (bf16 in, float32 accumulate): a 128 -> 128 layer is 8 k-steps of 4 MMAs per
// warp instead of 128 dependent FMAs per thread, and more rows cost nothing.
//
// Accuracy matches the float32 kernel's: the weights are bf16 already (exact), and each float32
// activation a enters as two bf16 operands, hi = bf16(a) and lo = bf16(a - hi), one MMA each into
// float32 accumulators, so the products carry ~16 significant bits of a (the error, ~2^-17 |a|
// per term, is far below the 1e-3 margin the encoder tests allow around zero). Inputs that are
// bf16 already skip the lo half at the first layer.
//
// Weights are staged once per block by 16-byte asynchronous copies into rows padded by 16 bytes:
// the B fragments then come from ldmatrix.trans without bank conflicts (a 256-byte row stride
// would put all eight rows of an 8x8 matrix in the same four banks).
#include "encode_mma.h"

#include <algorithm>
#include <type_traits>

#include <cuda_bf16.h>

#include "cuda_common.cuh"
#include "environment_overrides.h"

namespace hashattention {
namespace cuda {
namespace {

using namespace encode;

constexpr int kMmaThreads = 256;
constexpr int kMmaWarps = kMmaThreads / 32;
constexpr int kTileRows = 16;        // rows of one head per block: one m16 tile
// Up to this many rows per head the float32 kernel is as fast or faster: this kernel's time is
// ~10 us at any row count (not yet profiled: the cp.async staging and the prologue are the first
// suspects), the float32 one's grows with the rows
// (benchmarks/encoder.py, H200, pair launch of the paper's MLP on 32 + 32 heads, float32 / this
// kernel: 7.5 / 9.9 us at B = 1, 10.3 / 10.1 at 4, 12.1 / 10.2 at 8, 14.7 / 10.5 at 16).
constexpr int64_t kMinMmaRows = 4;
constexpr int kMaxMmaWidth = 256;    // widest layer: at most two 16-column slices per warp
constexpr int kSlicesPerWarp = kMaxMmaWidth / 16 / kMmaWarps;
constexpr int kRowPad = 8;           // bf16 elements of padding after each staged weight row (16 bytes)
static_assert(kMaxMmaWidth <= kMmaThreads, "one input column per thread");
constexpr int64_t kMaxMmaSharedBytes = 200 * 1024;

// Where a problem's staged weights and biases sit in shared memory (bf16 elements from the start of
// the bias area).
struct MmaProblemLayout {
  int bias_offset[kMaxLayers];
  int weight_offset[kMaxLayers];
};

struct MmaLaunch {
  FusedMlpLaunch work;
  MmaProblemLayout layouts[2];
  int act_stride;  // floats per activation row (both problems)
};

__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Four 8x8 bf16 matrices, transposed: lane l gives the address of row (l & 7) of matrix l / 8.
__device__ __forceinline__ void load_matrices_transposed(unsigned (&r)[4], const void* row_address) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row_address)));
#endif
}

__device__ __forceinline__ unsigned bf16_pair_bits(__nv_bfloat162 v) {
  return static_cast<unsigned>(__bfloat16_as_ushort(v.x)) | static_cast<unsigned>(__bfloat16_as_ushort(v.y)) << 16;
}

// Two float32 values (lower column first) as bf16 pairs: hi = bf16(v), lo = bf16(v - hi).
__device__ __forceinline__ void split_pair(float2 v, unsigned& hi, unsigned& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(v.x, v.y);
  hi = bf16_pair_bits(h);
  lo = bf16_pair_bits(__floats2bfloat162_rn(v.x - __low2float(h), v.y - __high2float(h)));
}

constexpr int kBatch = 4;  // k-steps of 16 whose loads are issued together

// kSteps k-steps of 16 from input column k0: this warp's column slices of act (kTileRows x fan_in,
// float32, rows `stride` floats apart) times the staged weights w (fan_in x fan_out bf16, rows
// w_stride apart), into hi / lo (the products of the activations' bf16 hi and lo halves).
template <int kSteps>
__device__ __forceinline__ void multiply_steps(const float* act, int stride, int k0, const __nv_bfloat16* w,
                                               int w_stride, int fan_out, bool exact,
                                               float (&hi)[kSlicesPerWarp][2][4], float (&lo)[kSlicesPerWarp][2][4]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, group = lane >> 2, quad = lane & 3;
  // A fragments: rows group and group + 8, columns k + 2 quad (+1) and k + 8 + 2 quad (+1).
  unsigned a_hi[kSteps][4], a_lo[kSteps][4];
#pragma unroll
  for (int j = 0; j < kSteps; ++j) {
    const float* a = act + k0 + 16 * j + 2 * quad;
    split_pair(*reinterpret_cast<const float2*>(a + group * stride), a_hi[j][0], a_lo[j][0]);
    split_pair(*reinterpret_cast<const float2*>(a + (group + 8) * stride), a_hi[j][1], a_lo[j][1]);
    split_pair(*reinterpret_cast<const float2*>(a + group * stride + 8), a_hi[j][2], a_lo[j][2]);
    split_pair(*reinterpret_cast<const float2*>(a + (group + 8) * stride + 8), a_hi[j][3], a_lo[j][3]);
  }
#pragma unroll
  for (int s = 0; s < kSlicesPerWarp; ++s) {
    const int n0 = (warp + s * kMmaWarps) * 16;
    if (n0 >= fan_out) break;  // warp-uniform
    // B fragments of columns n0 .. n0 + 7 and n0 + 8 .. n0 + 15: matrices (k rows 0-7, 8-15) x (those columns).
    unsigned b[kSteps][4];
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      load_matrices_transposed(b[j], w + (k0 + 16 * j + (lane & 15)) * w_stride + n0 + 8 * (lane >> 4));
    }
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      mma_bf16_16816(hi[s][0], a_hi[j], b[j][0], b[j][1]);
      mma_bf16_16816(hi[s][1], a_hi[j], b[j][2], b[j][3]);
      if (!exact) {
        mma_bf16_16816(lo[s][0], a_lo[j], b[j][0], b[j][1]);
        mma_bf16_16816(lo[s][1], a_lo[j], b[j][2], b[j][3]);
      }
    }
  }
}

template <typename x_t>
__global__ void __launch_bounds__(kMmaThreads) mma_mlp_sign_kernel(MmaLaunch launch) {
  const bool second = int64_t(blockIdx.x) >= launch.work.first_heads;
  const FusedMlpParams& p = launch.work.problems[second ? 1 : 0];
  const MmaProblemLayout& layout = launch.layouts[second ? 1 : 0];
  const int64_t h = second ? int64_t(blockIdx.x) - launch.work.first_heads : int64_t(blockIdx.x);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = lane >> 2, quad = lane & 3;  // mma fragment coordinates: row group, column pair
  const int rows = static_cast<int>(p.rows), stride = launch.act_stride;

  extern __shared__ float4 shared_raw[];
  float* act = reinterpret_cast<float*>(shared_raw);  // [kTileRows][stride], then the next layer's
  float* next = act + kTileRows * stride;
  __nv_bfloat16* staged = reinterpret_cast<__nv_bfloat16*>(next + kTileRows * stride);
  // Launched programmatically, as the fused kernel is: warm L2 with the weights, then wait.
  prefetch_weights_to_l2(p, h, static_cast<int>(sizeof(__nv_bfloat16)), kMmaThreads);
  wait_for_prerequisite_grids();

  // Every thread requests its share of the head's weight rows and biases as 16-byte asynchronous
  // copies into the padded rows (one bulk copy per row instead -- 387 for the paper's MLP, issued by
  // one warp -- took ~22 us per launch at any B: bulk copies that small are issue-bound).
  for (int layer = 0; layer < p.layers; ++layer) {
    const int fan_in = p.widths[layer], fan_out = p.widths[layer + 1];
    const int vectors = fan_out / 8;  // 8 bf16 per 16-byte vector
    const auto* w = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.weights[layer]) +
                                                   h * fan_in * fan_out);
    __nv_bfloat16* dst = staged + layout.weight_offset[layer];
    // Vector i of the layer is row i / vectors, column vector i % vectors; both advance by the
    // block's stride without a division per vector.
    const int row_step = kMmaThreads / vectors, vector_step = kMmaThreads % vectors;
    int k = static_cast<int>(threadIdx.x) / vectors, v = static_cast<int>(threadIdx.x) % vectors;
    for (int i = threadIdx.x; i < fan_in * vectors; i += kMmaThreads) {
      copy_async_16(dst + k * (fan_out + kRowPad) + 8 * v, w + i);
      k += row_step;
      v += vector_step;
      if (v >= vectors) {
        v -= vectors;
        ++k;
      }
    }
    const auto* b = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.biases[layer]) + h * fan_out);
    for (int i = threadIdx.x; i < vectors; i += kMmaThreads) copy_async_16(staged + layout.bias_offset[layer] + 8 * i, b + i);
  }

  // Inputs: thread k loads column k of every row (d <= kMmaThreads), all loads before the first
  // store (one round trip); rows past `rows` are zeros. The row's (batch, token) advance without a
  // division (a division per element made this the kernel's longest stretch of instructions).
  const int d = p.widths[0], k = static_cast<int>(threadIdx.x);
  const x_t* x = static_cast<const x_t*>(p.x) + (h / p.heads_per_x_head) * p.xs1 + k * p.xs3;
  const int tokens = static_cast<int>(p.tokens);
  x_t inputs[kTileRows];
  {
    int b = 0, n = 0;
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) {
      if (r < rows && k < d) inputs[r] = x[b * p.xs0 + n * p.xs2];
      if (++n == tokens) {
        n = 0;
        ++b;
      }
    }
  }
  if (k < d) {
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) act[r * stride + k] = r < rows ? static_cast<float>(inputs[r]) : 0.0f;
  }
  copy_async_wait_all();
  __syncthreads();  // the inputs and every thread's copies are in place

  for (int layer = 0; layer < p.layers; ++layer) {
    const int fan_in = p.widths[layer], fan_out = p.widths[layer + 1];
    const int w_stride = fan_out + kRowPad;
    const __nv_bfloat16* w = staged + layout.weight_offset[layer];
    const __nv_bfloat16* bias = staged + layout.bias_offset[layer];
    // bf16 inputs are exact in the hi half: the first layer skips the lo MMAs.
    const bool exact = layer == 0 && std::is_same_v<x_t, at::BFloat16>;
    float hi[kSlicesPerWarp][2][4] = {}, lo[kSlicesPerWarp][2][4] = {};
    // kBatch k-steps at a time, every shared-memory load of the batch ahead of its MMAs: the loads
    // and the ldmatrix are asm volatile or ordered behind the previous step's MMAs otherwise, which
    // made each k-step a full chain of shared-memory latencies (SASS of the one-step loop).
    int k0 = 0;
    for (; k0 + 16 * kBatch <= fan_in; k0 += 16 * kBatch) {
      multiply_steps<kBatch>(act, stride, k0, w, w_stride, fan_out, exact, hi, lo);
    }
    for (; k0 < fan_in; k0 += 16) multiply_steps<1>(act, stride, k0, w, w_stride, fan_out, exact, hi, lo);
    // Accumulator element c of tile t: row group (+8 for c >= 2), column n0 + 8 t + 2 quad (+1 for odd c).
    const bool last = layer + 1 == p.layers;
#pragma unroll
    for (int s = 0; s < kSlicesPerWarp; ++s) {
      const int n0 = (warp + s * kMmaWarps) * 16;
      if (n0 >= fan_out) break;
#pragma unroll
      for (int t = 0; t < 2; ++t) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int row = group + (c >= 2 ? 8 : 0), column = n0 + 8 * t + 2 * quad + (c & 1);
          const float v = hi[s][t][c] + lo[s][t][c] + __bfloat162float(bias[column]);
          next[row * stride + column] = last ? v : activate(v, p.activation);  // the last layer's pre-signs
        }
      }
    }
    __syncthreads();  // `next` is complete; `act` is free
    float* swap = act;
    act = next;
    next = swap;
  }

  // Signs to int32 words: one ballot per row and word (compare in float like the CPU kernel; NaN > 0 is false).
  const int words = p.widths[p.layers] / 32;
  for (int item = warp; item < rows * words; item += kMmaWarps) {
    const int r = item / words, word = item - r * words;
    const unsigned bits = __ballot_sync(0xffffffffu, act[r * stride + word * 32 + lane] > 0.0f);
    if (lane == 0) {
      const int b = r / tokens, n = r - b * tokens;
      int32_t* out = signature_row(p, b, h, n);
      if (out != nullptr) out[word] = static_cast<int32_t>(bits);
    }
  }
}

bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

// The shared-memory layout of problem p, or false when it does not fit the kernel.
bool describe_layout(const FusedMlpParams& p, MmaProblemLayout& layout, int64_t& staged_bytes, int& widest) {
  if (p.rows > kTileRows || p.layers < 1) return false;
  int64_t bias_elements = 0, weight_elements = 0;
  for (int layer = 0; layer <= p.layers; ++layer) {
    const int width = p.widths[layer];
    if (width % 16 != 0 || width > kMaxMmaWidth || width <= 0) return false;
    widest = std::max(widest, width);
  }
  for (int layer = 0; layer < p.layers; ++layer) {
    const int fan_out = p.widths[layer + 1];
    // Every head's block starts 16-byte aligned when the base does (fan_out is a multiple of 16).
    if (!aligned16(p.weights[layer]) || !aligned16(p.biases[layer])) return false;
    layout.bias_offset[layer] = static_cast<int>(bias_elements);
    bias_elements += fan_out;
  }
  for (int layer = 0; layer < p.layers; ++layer) {
    layout.weight_offset[layer] = static_cast<int>(bias_elements + weight_elements);
    weight_elements += int64_t(p.widths[layer]) * (p.widths[layer + 1] + kRowPad);
  }
  staged_bytes = 2 * (bias_elements + weight_elements);
  return true;
}

// Whether the kernel's code came from sm_80 or later (PTX of an older virtual architecture, JIT-compiled
// for this GPU, would hold no MMA instructions). Asked from the driver once per kernel.
template <typename Kernel>
bool compiled_with_mma(Kernel kernel) {
  cudaFuncAttributes attributes{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  return attributes.ptxVersion >= 80 && attributes.binaryVersion >= 80;
}

template <typename x_t>
bool launch_kernel(const MmaLaunch& launch, int problems, size_t smem) {
  auto kernel = mma_mlp_sign_kernel<x_t>;
  static const bool usable = compiled_with_mma(kernel);
  if (!usable) return false;
  allow_shared_memory(kernel, smem);
  int64_t heads = 0;
  for (int i = 0; i < problems; ++i) heads += launch.work.problems[i].heads;
  MmaLaunch params = launch;
  launch_with_single_argument(reinterpret_cast<const void*>(kernel), dim3(static_cast<unsigned>(heads)),
                              dim3(kMmaThreads), smem, &params);
  return true;
}

}  // namespace

bool launch_encode_mma(const FusedMlpLaunch& work, int problems, at::ScalarType x_type, at::ScalarType weight_type) {
  if (weight_type != at::kBFloat16 || at::cuda::getCurrentDeviceProperties()->major < 8) return false;
  if (x_type != at::kFloat && x_type != at::kHalf && x_type != at::kBFloat16) return false;
  // Unset (or a cluster choice that did not apply): this kernel for more than kMinMmaRows rows per
  // head; "mma" wherever it applies; "fma" never.
  const environment::EncoderChoice choice = environment::encoder_choice();
  if (choice == environment::EncoderChoice::kFma) return false;
  int64_t rows = 0;
  for (int i = 0; i < problems; ++i) rows = std::max(rows, work.problems[i].rows);
  if (choice != environment::EncoderChoice::kMma && rows <= kMinMmaRows) return false;
  MmaLaunch launch{};
  launch.work = work;
  int64_t staged = 0;
  int widest = 0;
  for (int i = 0; i < problems; ++i) {
    int64_t bytes = 0;
    if (!describe_layout(work.problems[i], launch.layouts[i], bytes, widest)) return false;
    staged = std::max(staged, bytes);
  }
  // Activation rows padded by 8 floats: the A-fragment loads of the eight row groups fall on different banks.
  launch.act_stride = widest + 8;
  const int64_t smem = int64_t(sizeof(float)) * 2 * kTileRows * launch.act_stride + staged;
  if (smem > kMaxMmaSharedBytes) return false;
  switch (x_type) {
    case at::kFloat: return launch_kernel<float>(launch, problems, static_cast<size_t>(smem));
    case at::kHalf: return launch_kernel<at::Half>(launch, problems, static_cast<size_t>(smem));
    default: return launch_kernel<at::BFloat16>(launch, problems, static_cast<size_t>(smem));
  }
}

}  // namespace cuda
}  // namespace hashattention
