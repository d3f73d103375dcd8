// Fused encoder for few rows: the whole per-head MLP, the sign and the packing in one kernel.
//
// A decode step encodes one new query and one new key row per head and sequence. Through ATen
// that is a chain of ~10 small kernels per call (dtype casts of the input and the weights,
// one batched matrix product per layer, bias adds, the activation, the sign-and-pack kernel),
// each a few microseconds of launch latency inside a CUDA graph. Here one block per (head,
// group of up to 8 rows) does it all. The kernel is latency-bound (a few dozen blocks, a few
// KB of weights each), so what matters is the number of dependent round trips to memory: each
// layer's weight matrix (in its own dtype) is first staged into shared memory with 16-byte
// loads, all in flight at once (in tiles of input rows when it is large), then the threads
// compute output units from shared memory in float32. A layer narrower than the block splits
// its inputs into runs, one per group of fan_out threads, whose partial sums are added in run
// order: every thread works and the dependent fma chains are shorter (B = 4: 17.1 -> 13.3 us
// per launch in benchmarks/encoder.py; B = 8: 28.8 -> 19.2). The last layer's signs become
// int32 words through warp ballots. Larger inputs
// (prefill) stay on the cuBLAS path, where the matrix products run on tensor cores.
//
// Inside a model the weights are not in L2 (the model's own weights stream through it between
// steps), so each block's staging is DRAM-latency-bound: the paper's 128 -> 128 -> 128 -> 32 MLP
// (72 KB per head in bf16) staged layer by layer with register round trips took ~13 us per
// launch (H200, Llama-3.1-8B shape, 64 launches per decode step). Now every layer's weights and
// biases are requested at once (bulk copies where aligned, else cp.async), the input rows load
// while they arrive, and there is one wait. After that the time is the warps' instruction chains,
// so per-layer constants (runs, the divider of a thread's run) come from the host: no thread
// divides (B = 1: 9.3 -> 7.5 us per pair launch, H200).
//
// A decode step encodes its query rows and its new key rows; at batch 1 each launch is ~9.5 us of
// latency (H200), so encode_signatures_pair runs both problems in ONE launch: the kernel takes two
// problem descriptors and the blocks beyond the first problem's heads serve the second. The key
// problem reads KV-head keys for per-query-head MLPs through a head divisor (MLP head h reads x
// head h / heads_per_x_head) instead of a repeated copy. encode_signatures launches the same
// kernel with one descriptor, so the two ops share every instantiation.
#include "encode_fused.h"

#include <algorithm>
#include <vector>

#include "cuda_common.cuh"
#include "encode_cluster.h"
#include "encode_common.cuh"
#include "encode_mma.h"
#include "environment_overrides.h"

namespace hashattention {
namespace cuda {
namespace {

using namespace encode;

// Threads per block. The kernel is a chain of short dependent steps (stage, layer, layer, ...), so
// its time is the length of one warp's instruction chain, not bytes: Nsight Compute at B = 1 shows
// IPC ~1 per multiprocessor and ~2,000 instructions per warp (H200). 1024 threads were slower than
// 256 (benchmarks/encoder.py, B = 1: 10.1 against 8.5 us per pair launch, both with bulk copies): the
// per-warp fixed work does not shrink, the partial sums to add grow.
constexpr int kEncodeThreads = 256;
constexpr int kRowsPerBlock = 8;            // most rows of one head per block (accumulators per thread)
constexpr int64_t kMaxWidth = 1024;         // widest layer kept in shared memory
constexpr int64_t kMaxRows = 64;            // rows per head (batch * tokens) up to which the fused path runs
// Rows per head up to which the automatic choice splits each head over a cluster of 2 blocks
// (encode_cluster.cu; benchmarks/encoder.py, H200: B = 1 / 4 7.39 / 9.39 us per pair launch
// against 7.72 / 11.39 here; at B = 8 the tensor-core kernel's 10.99 beats its 11.56).
constexpr int64_t kMaxAutoClusterRows = 4;
constexpr int64_t kStageBytes = 64 * 1024;  // weights staged per round trip when not all fit at once
constexpr int64_t kMaxSharedBytes = 200 * 1024;  // all layers' weights are staged up front if the block's total fits

// Elements a layer's weights take in the staging buffer: rounded up to 8 so that every layer's
// block starts 16-byte aligned.
__host__ __device__ __forceinline__ int64_t staged_elements(int64_t count) { return (count + 7) / 8 * 8; }


// Whether a block of `count` elements at `src` can go by bulk copy (16-byte address and size).
template <typename T>
__device__ __forceinline__ bool bulk_copyable(const T* src, int64_t count) {
  return reinterpret_cast<uintptr_t>(src) % 16 == 0 && (count * int64_t(sizeof(T))) % 16 == 0;
}

// Requests `count` elements from global to shared memory with every thread of the block: 16-byte
// asynchronous copies when both ends allow it (complete after copy_async_wait_all), element
// loads otherwise (complete on return).
template <typename T>
__device__ __forceinline__ void stage(T* __restrict__ dst, const T* __restrict__ src, int count) {
  const bool vector = (reinterpret_cast<uintptr_t>(src) % 16 == 0) && (count * sizeof(T)) % 16 == 0;
  if (vector) {
    const int vectors = static_cast<int>(count * sizeof(T) / 16);
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int i = threadIdx.x; i < vectors; i += kEncodeThreads) copy_async_16(d + i, s + i);
  } else {
#pragma unroll 8
    for (int i = threadIdx.x; i < count; i += kEncodeThreads) dst[i] = src[i];
  }
}

// kRows: rows per block, a power of two <= kRowsPerBlock (launch_fused picks it: one at decode,
// so that a step computes one accumulator per output unit, not eight).
template <typename x_t, typename w_t, int kRows>
__global__ void __launch_bounds__(kEncodeThreads) fused_mlp_sign_kernel(FusedMlpLaunch launch) {
  // Block-uniform choice of the problem; the grid's rows cover the larger problem, so the other
  // one's surplus row blocks leave at once (before any barrier).
  const bool second = int64_t(blockIdx.x) >= launch.first_heads;
  const FusedMlpParams& p = launch.problems[second ? 1 : 0];
  const int64_t h = second ? int64_t(blockIdx.x) - launch.first_heads : int64_t(blockIdx.x);
  const int64_t row0 = int64_t(blockIdx.y) * kRows;
  if (row0 >= p.rows) return;
  extern __shared__ float4 shared_raw[];  // 16-byte aligned
  __shared__ uint64_t bytes_landed;       // the bulk copies' mbarrier
  // Layout: two activation buffers of kRows * width_stride floats, the partial sums of a split
  // layer (kEncodeThreads * kRows floats), every layer's biases in their own dtype (bias_stride
  // each), then the weight staging buffer (every layer, or one tile). Every part starts 16-byte
  // aligned (width_stride is a multiple of 4 floats, bias_stride of 8 elements).
  float* in = reinterpret_cast<float*>(shared_raw);
  float* next = in + kRows * p.width_stride;
  float* partial = next + kRows * p.width_stride;
  w_t* biases = reinterpret_cast<w_t*>(partial + kEncodeThreads * kRows);
  const int64_t bias_stride = staged_elements(p.width_stride);
  w_t* staged = biases + p.layers * bias_stride;
  const int rows = static_cast<int>(min64(kRows, p.rows - row0));
  // Launched programmatically (launch_kernel), the block may run while the kernel before it
  // finishes: it warms L2 with its weights, then waits for that kernel before any read.
  prefetch_weights_to_l2(p, h, static_cast<int>(sizeof(w_t)), kEncodeThreads);
  wait_for_prerequisite_grids();

  // When every layer's weights fit in the staging buffer together (the paper's MLP: 72 KB in
  // bf16), they are all requested first, with the biases, so that they arrive while the inputs
  // load: by bulk copies when every block is 16-byte aligned (one thread issues them, one wait),
  // else by cp.async. Otherwise the weights go per layer, in tiles of input rows.
  const bool all_staged = p.all_staged;
  bool bulk = all_staged;
  for (int layer = 0; layer < p.layers && bulk; ++layer) {
    const int64_t count = int64_t(p.widths[layer]) * p.widths[layer + 1];
    bulk = bulk_copyable(static_cast<const w_t*>(p.weights[layer]) + h * count, count) &&
           bulk_copyable(static_cast<const w_t*>(p.biases[layer]) + h * p.widths[layer + 1], p.widths[layer + 1]);
  }
#if !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900)
  bulk = false;
#endif
  if (bulk) {
    if (threadIdx.x == 0) {
      unsigned bytes = 0;
      for (int layer = 0; layer < p.layers; ++layer) {
        bytes += static_cast<unsigned>(sizeof(w_t)) * p.widths[layer + 1] * (p.widths[layer] + 1);
      }
      bulk_copy_begin(&bytes_landed, bytes);
      int64_t offset = 0;
      for (int layer = 0; layer < p.layers; ++layer) {
        const int fan_in = p.widths[layer], fan_out = p.widths[layer + 1];
        const int64_t count = int64_t(fan_in) * fan_out;
        bulk_copy(staged + offset, static_cast<const w_t*>(p.weights[layer]) + h * count,
                  static_cast<unsigned>(count * sizeof(w_t)), &bytes_landed);
        bulk_copy(biases + layer * bias_stride, static_cast<const w_t*>(p.biases[layer]) + h * fan_out,
                  static_cast<unsigned>(fan_out * sizeof(w_t)), &bytes_landed);
        offset += staged_elements(count);
      }
    }
  } else {
    int64_t offset = 0;
    for (int layer = 0; layer < p.layers; ++layer) {
      const int fan_out = p.widths[layer + 1];
      const int count = p.widths[layer] * fan_out;
      if (all_staged) stage(staged + offset, static_cast<const w_t*>(p.weights[layer]) + h * count, count);
      stage(biases + layer * bias_stride, static_cast<const w_t*>(p.biases[layer]) + h * fan_out, fan_out);
      offset += staged_elements(count);
    }
  }

  // The inputs: every load is issued before the first store to shared memory, so that they are
  // all in flight together (a store between two loads through generic pointers would order
  // them: one DRAM round trip each). Thread t holds elements t, t + kEncodeThreads, ...
  constexpr int kInputsPerThread = (kRows * kMaxWidth + kEncodeThreads - 1) / kEncodeThreads;
  const x_t* x = static_cast<const x_t*>(p.x) + (h / p.heads_per_x_head) * p.xs1;
  const int d = p.widths[0];
  x_t inputs[kInputsPerThread];
#pragma unroll
  for (int e = 0; e < kInputsPerThread; ++e) {
    const int i = static_cast<int>(threadIdx.x) + e * kEncodeThreads, r = i / d, k = i % d;
    if (i < kRows * d && r < rows) {
      // 32-bit: the fused path takes at most kMaxRows rows.
      const int row = static_cast<int>(row0) + r, tokens = static_cast<int>(p.tokens);
      const int b = row / tokens, n = row - b * tokens;
      inputs[e] = x[b * p.xs0 + n * p.xs2 + k * p.xs3];
    }
  }
#pragma unroll
  for (int e = 0; e < kInputsPerThread; ++e) {
    const int i = static_cast<int>(threadIdx.x) + e * kEncodeThreads, r = i / d, k = i % d;
    if (i < kRows * d) in[r * p.width_stride + k] = r < rows ? static_cast<float>(inputs[e]) : 0.0f;
  }
  if (bulk) {
    __syncthreads();  // the mbarrier is initialised before anyone waits on it
    bulk_copy_wait(&bytes_landed);
  } else {
    copy_async_wait_all();  // the barrier at the first tile publishes it to the block
  }

  const int lane = threadIdx.x & 31;
  int64_t layer_offset = 0;  // where this layer's weights start in `staged` when all_staged
  for (int layer = 0; layer < p.layers; ++layer) {
    const int fan_in = p.widths[layer], fan_out = p.widths[layer + 1];
    const bool last = layer + 1 == p.layers;
    const w_t* w = static_cast<const w_t*>(p.weights[layer]) + int64_t(h) * fan_in * fan_out;
    // Tiles start at multiples of 4 input rows, so the float4 reads of the activations stay aligned.
    const int tile_rows = all_staged ? fan_in : max(4, static_cast<int>(kStageBytes / (sizeof(w_t) * fan_out)) / 4 * 4);
    // A layer narrower than the block splits its inputs into `slices` runs, one per group of
    // fan_out threads (the 128-wide layers: 8 runs of 16 inputs, the 32-bit output layer: 32 runs
    // of 4), so every thread works and the dependent chain of fmas is slices times shorter; the
    // runs' partial sums are added in run order afterwards. A layer at least as wide as the
    // block has one run, and each thread owns units j, j + kEncodeThreads, ... (at most
    // kMaxWidth / kEncodeThreads of them).
    const int slices = p.slices[layer];
    const int slice = slices > 1 ? static_cast<int>((threadIdx.x * p.slice_divider[layer]) >> 20) : 0;
    const int units = slices > 1 ? (slice < slices ? 1 : 0) : kMaxWidth / kEncodeThreads;
    const int j0 = slices > 1 ? static_cast<int>(threadIdx.x) - slice * fan_out : static_cast<int>(threadIdx.x);
    float acc[kMaxWidth / kEncodeThreads][kRows];
#pragma unroll
    for (int u = 0; u < kMaxWidth / kEncodeThreads; ++u) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[u][r] = 0.0f;
    }
    for (int k0 = 0; k0 < fan_in; k0 += tile_rows) {
      const int k_count = min(tile_rows, fan_in - k0);
      __syncthreads();  // the previous tile (or layer) is consumed, the activations are written
      if (!all_staged) {
        stage(staged, w + k0 * fan_out, k_count * fan_out);
        copy_async_wait_all();
        __syncthreads();
      }
      const w_t* tile = all_staged ? staged + layer_offset : staged;
      // This thread's run of the tile's inputs: a multiple of 4 long, so that it starts aligned.
      const int run = all_staged ? p.full_run[layer] : (ceil_div(k_count, slices) + 3) / 4 * 4;
      const int k_begin = min(k_count, slice * run), k_end = min(k_count, k_begin + run);
#pragma unroll
      for (int u = 0; u < kMaxWidth / kEncodeThreads; ++u) {
        const int j = j0 + u * kEncodeThreads;
        if (u >= units || j >= fan_out) break;
        int k = k_begin;
#pragma unroll 2
        for (; k + 4 <= k_end; k += 4) {
          const float w0 = static_cast<float>(tile[(k + 0) * fan_out + j]);
          const float w1 = static_cast<float>(tile[(k + 1) * fan_out + j]);
          const float w2 = static_cast<float>(tile[(k + 2) * fan_out + j]);
          const float w3 = static_cast<float>(tile[(k + 3) * fan_out + j]);
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            const float4 v = *reinterpret_cast<const float4*>(in + r * p.width_stride + k0 + k);
            acc[u][r] = fmaf(v.w, w3, fmaf(v.z, w2, fmaf(v.y, w1, fmaf(v.x, w0, acc[u][r]))));
          }
        }
        for (; k < k_end; ++k) {
          const float wk = static_cast<float>(tile[k * fan_out + j]);
#pragma unroll
          for (int r = 0; r < kRows; ++r) acc[u][r] = fmaf(in[r * p.width_stride + k0 + k], wk, acc[u][r]);
        }
      }
    }
    layer_offset += staged_elements(int64_t(fan_in) * fan_out);
    if (slices > 1) {
      // Add the runs' partial sums in run order: thread j < fan_out ends up with unit j's sum.
      if (units > 0) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) partial[(slice * kRows + r) * fan_out + j0] = acc[0][r];
      }
      __syncthreads();
      if (static_cast<int>(threadIdx.x) < fan_out) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          float sum = partial[r * fan_out + j0];
          for (int s = 1; s < slices; ++s) sum += partial[(s * kRows + r) * fan_out + j0];
          acc[0][r] = sum;
        }
      }
    }
    // Threads that hold finished sums: units j0 + u * kEncodeThreads (one run), or j0 < fan_out (split).
    const int finished = slices > 1 ? (static_cast<int>(threadIdx.x) < fan_out ? 1 : 0) : units;
#pragma unroll
    for (int u = 0; u < kMaxWidth / kEncodeThreads; ++u) {
      const int j = j0 + u * kEncodeThreads;
      if (u >= finished || j >= fan_out) break;  // warp-uniform for the last layer: its width is a multiple of 32
      const float bj = static_cast<float>(biases[layer * bias_stride + j]);
      if (!last) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) next[r * p.width_stride + j] = r < rows ? activate(acc[u][r] + bj, p.activation) : 0.0f;
      } else {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          // Compare in float like the CPU kernel; NaN > 0 is false: bit 0.
          const unsigned word = __ballot_sync(0xffffffffu, acc[u][r] + bj > 0.0f);
          if (lane == 0 && r < rows) {
            const int row = static_cast<int>(row0) + r, tokens = static_cast<int>(p.tokens);
            const int b = row / tokens, n = row - b * tokens;
            int32_t* out = signature_row(p, b, h, n);
            if (out != nullptr) out[j / 32] = static_cast<int32_t>(word);
          }
        }
      }
    }
    float* t = in;
    in = next;
    next = t;
  }
}

int activation_code(const std::string& activation) {
  if (activation == "silu") return kSilu;
  if (activation == "relu") return kRelu;
  if (activation == "gelu") return kGelu;
  if (activation == "tanh") return kTanh;
  return kIdentity;
}

// Dynamic shared memory one block of problem p needs: activations and biases, then every
// layer's weights at once when the total fits (each layer rounded up to 8 elements, as
// staged_elements does; sets p.all_staged), else kStageBytes tiles (at most 64 + 32 + 64 KB with
// kMaxWidth and kRowsPerBlock).
template <typename w_t, int kRows>
int64_t prepare_shared_memory(FusedMlpParams& p) {
  const int64_t floats = int64_t(sizeof(float)) * (2 * kRows * p.width_stride + kEncodeThreads * kRows) +
                         int64_t(sizeof(w_t)) * p.layers * staged_elements(p.width_stride);  // + the biases
  int64_t weights = 0;
  for (int layer = 0; layer < p.layers; ++layer) weights += staged_elements(int64_t(p.widths[layer]) * p.widths[layer + 1]);
  weights *= int64_t(sizeof(w_t));
  p.all_staged = floats + weights <= kMaxSharedBytes;
  return floats + (p.all_staged ? weights : kStageBytes);
}

template <typename x_t, typename w_t, int kRows>
void launch_kernel(FusedMlpLaunch launch, int problems, dim3 grid) {
  int64_t smem = 0;  // the larger problem's layout; each problem uses its own within it
  for (int i = 0; i < problems; ++i) smem = std::max(smem, prepare_shared_memory<w_t, kRows>(launch.problems[i]));
  auto kernel = fused_mlp_sign_kernel<x_t, w_t, kRows>;
  allow_shared_memory(kernel, static_cast<size_t>(smem));
  launch_with_single_argument(reinterpret_cast<const void*>(kernel), grid, dim3(kEncodeThreads),
                              static_cast<size_t>(smem), &launch);
}

template <typename x_t, int kRows>
void launch_for_input(const FusedMlpLaunch& launch, int problems, at::ScalarType weight_type, dim3 grid) {
  switch (weight_type) {  // fused_encode_applies admits these three
    case at::kFloat: return launch_kernel<x_t, float, kRows>(launch, problems, grid);
    case at::kHalf: return launch_kernel<x_t, at::Half, kRows>(launch, problems, grid);
    case at::kBFloat16: return launch_kernel<x_t, at::BFloat16, kRows>(launch, problems, grid);
    default: TORCH_CHECK(false, "encode_signatures: internal error: no fused kernel for weights of type ", weight_type);
  }
}

template <int kRows>
void launch_rows(const FusedMlpLaunch& launch, int problems, at::ScalarType x_type, at::ScalarType weight_type) {
  int64_t heads = 0, rows = 0;
  for (int i = 0; i < problems; ++i) {
    heads += launch.problems[i].heads;
    rows = std::max(rows, launch.problems[i].rows);
  }
  const dim3 grid(static_cast<unsigned>(heads), static_cast<unsigned>(ceil_div(rows, int64_t(kRows))));
  switch (x_type) {
    case at::kFloat: return launch_for_input<float, kRows>(launch, problems, weight_type, grid);
    case at::kHalf: return launch_for_input<at::Half, kRows>(launch, problems, weight_type, grid);
    case at::kBFloat16: return launch_for_input<at::BFloat16, kRows>(launch, problems, weight_type, grid);
    default: TORCH_CHECK(false, "encode_signatures: internal error: no fused kernel for x of type ", x_type);
  }
}

// Launches the fused kernel once for `problems` (1 or 2) non-empty problems of the same x and
// weight dtypes. Rows per block: the fewest that keep the grid within two blocks per
// multiprocessor. A block's time grows with its rows (the fma chains lengthen: B = 1 / 4 / 8 took
// 9.3 / 13.3 / 19.2 us per pair launch with all of a head's rows in one block, H200), while more
// blocks of one head only re-read its weights from L2; so a decode step at B = 4 (a pair launch:
// 64 heads) runs 256 one-row blocks, and prefill-sized row counts take 8 rows per block.
void launch_fused(const FusedMlpLaunch& launch, int problems, at::ScalarType x_type, at::ScalarType weight_type) {
  // Up to kMaxAutoClusterRows rows per head, or when HASHATTENTION_ENCODER=cluster2 / cluster4
  // asks for it: each head split over a cluster of blocks (encode_cluster.cu), wherever that kernel
  // applies (sm_90, float16 / bfloat16, power-of-two widths up to 256).
  using environment::EncoderChoice;
  const EncoderChoice choice = environment::encoder_choice();
  int64_t most_rows = 0;
  for (int i = 0; i < problems; ++i) most_rows = std::max(most_rows, launch.problems[i].rows);
  const bool cluster = choice == EncoderChoice::kCluster2 || choice == EncoderChoice::kCluster4 ||
                       ((choice == EncoderChoice::kAuto || choice == EncoderChoice::kSkip) && most_rows <= kMaxAutoClusterRows);
  if (cluster && launch_encode_cluster(launch, problems, x_type, weight_type, choice == EncoderChoice::kCluster4 ? 4 : 2)) {
    return;
  }
  // bf16 weights and 5-16 rows per head: the tensor-core kernel (encode_mma.cu), ~10 us at any row
  // count, where this one's FMA chains grow with the rows.
  if (launch_encode_mma(launch, problems, x_type, weight_type)) return;
  int64_t rows = 0, heads = 0;
  for (int i = 0; i < problems; ++i) {
    rows = std::max(rows, launch.problems[i].rows);
    heads += launch.problems[i].heads;
  }
  const int64_t blocks = 2 * multiprocessor_count();
  if (heads * rows <= blocks) return launch_rows<1>(launch, problems, x_type, weight_type);
  if (heads * ceil_div(rows, int64_t(2)) <= blocks) return launch_rows<2>(launch, problems, x_type, weight_type);
  if (heads * ceil_div(rows, int64_t(4)) <= blocks) return launch_rows<4>(launch, problems, x_type, weight_type);
  launch_rows<kRowsPerBlock>(launch, problems, x_type, weight_type);
}

// The descriptor of one problem: x (B, Hx, N, D) any strides, weights[i] (H, in, out) and
// biases[i] (H, out) with Hx dividing H, out int32 (B, H, N, words) with contiguous words -- or,
// with `positions` (int64 (N,)), out (B, H, S, words) and token n written to slot positions[n].
// Contiguous copies of the weights (usually the tensors themselves) are appended to `kept`, which
// must outlive the launch.
FusedMlpParams describe_problem(const at::Tensor& x, at::TensorList weights, at::TensorList biases, int activation,
                                at::Tensor& out, std::vector<at::Tensor>& kept,
                                const at::Tensor& positions = at::Tensor()) {
  FusedMlpParams p{};
  p.x = x.data_ptr();
  p.xs0 = x.stride(0), p.xs1 = x.stride(1), p.xs2 = x.stride(2), p.xs3 = x.stride(3);
  p.tokens = x.size(2), p.rows = x.size(0) * x.size(2);
  p.heads = weights[0].size(0);
  p.heads_per_x_head = x.size(1) > 0 ? p.heads / x.size(1) : 1;
  p.layers = static_cast<int>(weights.size());
  p.widths[0] = static_cast<int>(x.size(3));
  int64_t widest = x.size(3);
  for (size_t i = 0; i < weights.size(); ++i) {
    kept.push_back(weights[i].contiguous());
    p.weights[i] = kept.back().data_ptr();
    kept.push_back(biases[i].contiguous());
    p.biases[i] = kept.back().data_ptr();
    p.widths[i + 1] = static_cast<int>(weights[i].size(2));
    const int fan_in = p.widths[i], fan_out = p.widths[i + 1];
    p.slices[i] = fan_out >= kEncodeThreads || fan_out < 1 ? 1 : kEncodeThreads / fan_out;
    p.slice_divider[i] = fan_out < 1 ? 0u : static_cast<unsigned>(((1u << 20) + fan_out - 1) / fan_out);
    p.full_run[i] = (ceil_div(fan_in, p.slices[i]) + 3) / 4 * 4;
    widest = std::max<int64_t>(widest, weights[i].size(2));
  }
  p.activation = activation;
  p.out = out.data_ptr<int32_t>();
  p.os0 = out.stride(0), p.os1 = out.stride(1), p.os2 = out.stride(2);
  p.positions = positions.defined() ? positions.data_ptr<int64_t>() : nullptr;
  p.slots = out.size(2);
  p.width_stride = ceil_div(widest, int64_t(4)) * 4;  // keeps the staged weights 16-byte aligned
  return p;
}

bool is_empty_problem(const FusedMlpParams& p) { return p.rows == 0 || p.heads == 0; }

}  // namespace

bool fused_encode_applies(const at::Tensor& x, at::TensorList weights, at::TensorList biases) {
  if (x.size(0) * x.size(2) > kMaxRows || weights.size() > size_t(kMaxLayers)) return false;
  // float64 inputs or weights take the cuBLAS path (it also computes in float32).
  const at::ScalarType weight_type = weights[0].scalar_type();
  if (x.scalar_type() == at::kDouble || weight_type == at::kDouble) return false;
  if (x.size(3) > kMaxWidth) return false;
  for (size_t i = 0; i < weights.size(); ++i) {
    // One weight dtype for every layer and bias keeps the instantiations to 3 x 3.
    if (weights[i].scalar_type() != weight_type || biases[i].scalar_type() != weight_type) return false;
    if (weights[i].size(2) > kMaxWidth) return false;
  }
  return true;
}

bool fused_encode_pair_applies(const at::Tensor& query, at::TensorList query_weights, at::TensorList query_biases,
                               const at::Tensor& key, at::TensorList key_weights, at::TensorList key_biases) {
  return fused_encode_applies(query, query_weights, query_biases) && fused_encode_applies(key, key_weights, key_biases) &&
         query.scalar_type() == key.scalar_type() && query_weights[0].scalar_type() == key_weights[0].scalar_type();
}

void encode_fused_cuda(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                       const std::string& activation, at::Tensor& out) {
  std::vector<at::Tensor> kept;
  FusedMlpLaunch work{};
  work.problems[0] = describe_problem(x, weights, biases, activation_code(activation), out, kept);
  if (is_empty_problem(work.problems[0])) return;
  work.first_heads = work.problems[0].heads;
  launch_fused(work, 1, x.scalar_type(), weights[0].scalar_type());
}

void encode_fused_pair_cuda(const at::Tensor& query, at::TensorList query_weights, at::TensorList query_biases,
                            at::Tensor& query_out, const at::Tensor& key, at::TensorList key_weights,
                            at::TensorList key_biases, at::Tensor& key_out, const std::string& activation,
                            const at::Tensor& key_positions) {
  std::vector<at::Tensor> kept;
  const int code = activation_code(activation);
  const FusedMlpParams described[2] = {
      describe_problem(query, query_weights, query_biases, code, query_out, kept),
      describe_problem(key, key_weights, key_biases, code, key_out, kept, key_positions),
  };
  // Empty problems get no blocks (an empty key chunk, say), so the launch has one or two problems.
  FusedMlpLaunch work{};
  int problems = 0;
  for (const FusedMlpParams& p : described) {
    if (!is_empty_problem(p)) work.problems[problems++] = p;
  }
  if (problems == 0) return;
  work.first_heads = work.problems[0].heads;
  launch_fused(work, problems, query.scalar_type(), query_weights[0].scalar_type());
}

}  // namespace cuda
}  // namespace hashattention
