// Few-rows encoder with each head's MLP split over a thread-block cluster (sm_90).
//
// The one-block-per-head kernels (encode_fused.cu, encode_mma.cu) each stage a head's whole MLP
// (72 KB in bf16 for the paper's 128 -> 128 -> 128 -> 32) into one multiprocessor and run every
// layer's dot products there: ~7.5 us per pair launch at B = 1 and ~11 us at B = 4 on an H200,
// where the bytes and the FMAs are a small fraction of the machine. Here a cluster of C blocks
// (C = 2 or 4) serves one head and one group of rows, and block r owns the r-th C-th of every
// layer's *inputs*: it stages only those rows of each weight matrix (one bulk copy per layer, a
// C-th of the bytes), computes the partial sums of every output unit over its inputs (a C-th of
// the FMAs), and leaves them in its shared memory. After a cluster barrier block r adds, for its
// own C-th of the output units, the partial sums of all C blocks (read through distributed shared
// memory, in block order, so the result does not depend on timing), adds the bias and applies the
// activation: exactly the inputs it owns in the next layer (a reduce-scatter). For the last layer
// block 0 adds every unit's partial sums and turns the signs into int32 words by warp ballots.
//
// Per layer: one block barrier and one cluster barrier. Partial sums alternate between two
// buffers by layer parity: a block rewrites a buffer only after the next cluster barrier, which
// every peer passes only after it has read that buffer. The final cluster barrier keeps every
// block's shared memory alive until block 0 has read it.
//
// Blocks of one cluster share blockIdx.y (the row group), so a cluster whose rows lie beyond its
// problem's leaves as a whole, before any barrier.
#include "encode_cluster.h"

#include <cooperative_groups.h>

#include <algorithm>

#include "cuda_common.cuh"

namespace hashattention {
namespace cuda {

namespace {

using namespace encode;
namespace cg = cooperative_groups;

constexpr int kClusterThreads = 256;
constexpr int kMaxUnits = 256;        // widest layer output: every width divides kClusterThreads
constexpr int kMaxClusterRows = 64;   // rows per head (batch * tokens) up to which this kernel runs
constexpr int64_t kMaxClusterSharedBytes = 160 * 1024;

// Where a problem's pieces live in a block's shared memory and how its threads split each layer;
// computed on the host (no thread divides by a run-time width: widths are powers of two).
struct ClusterLayout {
  int in_slice[kMaxLayers];       // inputs of layer l a block owns: widths[l] / C
  int run[kMaxLayers];            // inputs per thread (a multiple of 4, for float4 activation reads)
  int out_shift[kMaxLayers];      // log2(widths[l + 1])
  int slice_shift[kMaxLayers];    // log2(in_slice of layer l + 1) for hidden layers
  int weight_offset[kMaxLayers];  // elements into the staged weights (multiples of 8)
  int bias_offset[kMaxLayers];    // elements into the staged biases (multiples of 8)
  int in_stride;                  // floats per row of the activation buffer (a multiple of 4)
  int bias_elements;              // staged bias elements (a multiple of 8)
  unsigned bulk_bytes;            // bytes the bulk copies bring; 0: element loads instead
};

struct ClusterLaunch {
  FusedMlpLaunch work;
  ClusterLayout layouts[2];
};

template <typename w_t, int kRows>
__device__ __forceinline__ void accumulate(float (&acc)[kRows], const float* __restrict__ in, int in_stride,
                                           const w_t* __restrict__ w, int fan_out, int j, int k_begin, int k_end) {
  int k = k_begin;
#pragma unroll 2
  for (; k + 4 <= k_end; k += 4) {
    const float w0 = static_cast<float>(w[(k + 0) * fan_out + j]);
    const float w1 = static_cast<float>(w[(k + 1) * fan_out + j]);
    const float w2 = static_cast<float>(w[(k + 2) * fan_out + j]);
    const float w3 = static_cast<float>(w[(k + 3) * fan_out + j]);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float4 v = *reinterpret_cast<const float4*>(in + r * in_stride + k);
      acc[r] = fmaf(v.w, w3, fmaf(v.z, w2, fmaf(v.y, w1, fmaf(v.x, w0, acc[r]))));
    }
  }
  for (; k < k_end; ++k) {
    const float wk = static_cast<float>(w[k * fan_out + j]);
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] = fmaf(in[r * in_stride + k], wk, acc[r]);
  }
}

template <typename x_t, typename w_t, int kRows, int kBlocks>
__global__ void __launch_bounds__(kClusterThreads) cluster_mlp_sign_kernel(const __grid_constant__ ClusterLaunch launch) {
  // Clusters are sm_90: code built for an older architecture is empty, and the host never launches
  // it (kernel_built_for_sm90).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t unit = int64_t(blockIdx.x) / kBlocks;  // (problem, head) of this cluster
  const bool second = unit >= launch.work.first_heads;
  const FusedMlpParams& p = launch.work.problems[second ? 1 : 0];
  const ClusterLayout& layout = launch.layouts[second ? 1 : 0];
  const int64_t h = second ? unit - launch.work.first_heads : unit;
  const int64_t row0 = int64_t(blockIdx.y) * kRows;
  if (row0 >= p.rows) return;  // the whole cluster: its blocks share blockIdx.y
  const int rows = static_cast<int>(min64(kRows, p.rows - row0));
  const int tokens = static_cast<int>(p.tokens);  // 32-bit: at most kMaxClusterRows rows

  // Shared memory: this block's inputs (kRows x in_stride floats), the threads' partial sums per run
  // ([run][row][unit], kRows x kMaxUnits), the block's partial sums its peers read (two buffers of
  // [row][unit]), every layer's biases, then this block's rows of every layer's weights.
  extern __shared__ float4 shared_raw[];  // 16-byte aligned
  __shared__ uint64_t bytes_landed;
  float* in = reinterpret_cast<float*>(shared_raw);
  float* runs_sums = in + kRows * layout.in_stride;
  float* exposed_buffers = runs_sums + kRows * kMaxUnits;
  w_t* biases = reinterpret_cast<w_t*>(exposed_buffers + 2 * kRows * kMaxUnits);
  w_t* weights = biases + layout.bias_elements;

  // Launched programmatically, the block may start while the kernel before it finishes: nothing is
  // read before this wait (an optimizer step right before may have rewritten the weights).
  wait_for_prerequisite_grids();

  if (layout.bulk_bytes != 0) {
    if (threadIdx.x == 0) {
      bulk_copy_begin(&bytes_landed, layout.bulk_bytes);
      for (int layer = 0; layer < p.layers; ++layer) {
        const int fan_in = p.widths[layer], fan_out = p.widths[layer + 1], in_slice = layout.in_slice[layer];
        const w_t* w = static_cast<const w_t*>(p.weights[layer]) + (h * fan_in + rank * in_slice) * fan_out;
        bulk_copy(weights + layout.weight_offset[layer], w, static_cast<unsigned>(sizeof(w_t) * in_slice * fan_out),
                  &bytes_landed);
        bulk_copy(biases + layout.bias_offset[layer], static_cast<const w_t*>(p.biases[layer]) + h * fan_out,
                  static_cast<unsigned>(sizeof(w_t) * fan_out), &bytes_landed);
      }
    }
  } else {
    for (int layer = 0; layer < p.layers; ++layer) {
      const int fan_in = p.widths[layer], fan_out = p.widths[layer + 1], in_slice = layout.in_slice[layer];
      const w_t* w = static_cast<const w_t*>(p.weights[layer]) + (h * fan_in + rank * in_slice) * fan_out;
      for (int i = threadIdx.x; i < in_slice * fan_out; i += kClusterThreads) weights[layout.weight_offset[layer] + i] = w[i];
      const w_t* b = static_cast<const w_t*>(p.biases[layer]) + h * fan_out;
      for (int i = threadIdx.x; i < fan_out; i += kClusterThreads) biases[layout.bias_offset[layer] + i] = b[i];
    }
  }

  // This block's C-th of the inputs of its rows, in float32.
  {
    const int d = layout.in_slice[0];
    const x_t* x = static_cast<const x_t*>(p.x) + (h / p.heads_per_x_head) * p.xs1 + int64_t(rank) * d * p.xs3;
    for (int i = threadIdx.x; i < kRows * d; i += kClusterThreads) {
      const int r = i / d, k = i - r * d;
      float v = 0.0f;
      if (r < rows) {
        const int row = static_cast<int>(row0) + r, b = row / tokens, n = row - b * tokens;
        v = static_cast<float>(x[b * p.xs0 + n * p.xs2 + k * p.xs3]);
      }
      in[r * layout.in_stride + k] = v;
    }
  }
  __syncthreads();  // the inputs are written and the mbarrier is initialised before anyone waits on it
  if (layout.bulk_bytes != 0) bulk_copy_wait(&bytes_landed);

  const int lane = threadIdx.x & 31;
  for (int layer = 0; layer < p.layers; ++layer) {
    const int fan_out = p.widths[layer + 1], in_slice = layout.in_slice[layer];
    const int out_shift = layout.out_shift[layer], runs = kClusterThreads >> out_shift;
    // Thread t: unit j = t mod fan_out over run s = t / fan_out of this block's inputs.
    const int j = static_cast<int>(threadIdx.x) & (fan_out - 1), s = static_cast<int>(threadIdx.x) >> out_shift;
    const int k_begin = min(in_slice, s * layout.run[layer]), k_end = min(in_slice, k_begin + layout.run[layer]);
    float acc[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;
    accumulate<w_t, kRows>(acc, in, layout.in_stride, weights + layout.weight_offset[layer], fan_out, j, k_begin, k_end);

    // The block's partial sum of each (row, unit): the runs added in run order, on chip.
    float* exposed = exposed_buffers + (layer & 1) * kRows * kMaxUnits;  // [row][unit]
    if (runs == 1) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) exposed[r * fan_out + j] = acc[r];
    } else {
#pragma unroll
      for (int r = 0; r < kRows; ++r) runs_sums[(s * kRows + r) * fan_out + j] = acc[r];
      __syncthreads();
      for (int i = threadIdx.x; i < kRows * fan_out; i += kClusterThreads) {
        const int r = i >> out_shift, u = i & (fan_out - 1);
        float sum = 0.0f;
        for (int t = 0; t < runs; ++t) sum += runs_sums[(t * kRows + r) * fan_out + u];
        exposed[i] = sum;
      }
    }
    cluster.sync();  // every block's partial sums are written (and this block is done with `in`)

    if (layer + 1 < p.layers) {
      // Reduce-scatter: this block's C-th of the units becomes its C-th of the next layer's inputs.
      const int out_slice = layout.in_slice[layer + 1], slice_shift = layout.slice_shift[layer];
      for (int i = threadIdx.x; i < kRows * out_slice; i += kClusterThreads) {
        const int r = i >> slice_shift, local = i & (out_slice - 1), unit_j = rank * out_slice + local;
        float part[kBlocks];
#pragma unroll
        for (int q = 0; q < kBlocks; ++q) part[q] = cluster.map_shared_rank(exposed, q)[r * fan_out + unit_j];
        float sum = part[0];
#pragma unroll
        for (int q = 1; q < kBlocks; ++q) sum += part[q];
        const float b = static_cast<float>(biases[layout.bias_offset[layer] + unit_j]);
        in[r * layout.in_stride + local] = r < rows ? activate(sum + b, p.activation) : 0.0f;
      }
      __syncthreads();  // the next layer's inputs are written
    } else {
      if (rank == 0) {
        // kRows * fan_out is a multiple of 32 (fan_out is), so every warp runs whole iterations and
        // its 32 lanes hold one word of one row.
        for (int i = threadIdx.x; i < kRows * fan_out; i += kClusterThreads) {
          const int r = i >> out_shift, unit_j = i & (fan_out - 1);
          float part[kBlocks];
#pragma unroll
          for (int q = 0; q < kBlocks; ++q) part[q] = cluster.map_shared_rank(exposed, q)[i];
          float sum = part[0];
#pragma unroll
          for (int q = 1; q < kBlocks; ++q) sum += part[q];
          const float b = static_cast<float>(biases[layout.bias_offset[layer] + unit_j]);
          // Compare in float like the CPU kernel; NaN > 0 is false: bit 0.
          const unsigned word = __ballot_sync(0xffffffffu, sum + b > 0.0f);
          if (lane == 0 && r < rows) {
            const int row = static_cast<int>(row0) + r, bb = row / tokens, n = row - bb * tokens;
            int32_t* out = signature_row(p, bb, h, n);
            if (out != nullptr) out[unit_j / 32] = static_cast<int32_t>(word);
          }
        }
      }
      cluster.sync();  // every block's shared memory stays alive until block 0 has read it
    }
  }
#endif
}

int log2_exact(int value) {
  int shift = 0;
  while ((1 << shift) < value) ++shift;
  return shift;
}

bool is_power_of_two(int value) { return value > 0 && (value & (value - 1)) == 0; }

bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

int64_t round_up(int64_t value, int64_t multiple) { return ceil_div(value, multiple) * multiple; }

// Fills `layout` for problem p split over `blocks` blocks, or returns false when the kernel does
// not apply. `bytes` receives the block's dynamic shared memory for kRows rows.
bool describe_cluster_layout(const FusedMlpParams& p, int blocks, int rows_per_block, int element_bytes,
                             ClusterLayout& layout, int64_t& bytes) {
  if (p.layers < 1 || p.layers > kMaxLayers || p.rows > kMaxClusterRows) return false;
  if (p.widths[0] % blocks != 0) return false;
  int64_t weight_elements = 0, bias_elements = 0, bulk_bytes = 0;
  int widest_slice = 0;
  bool bulk = true;
  for (int layer = 0; layer < p.layers; ++layer) {
    const int fan_in = p.widths[layer], fan_out = p.widths[layer + 1];
    if (!is_power_of_two(fan_out) || fan_out > kMaxUnits || fan_out % blocks != 0) return false;
    if (layer + 1 == p.layers && fan_out % 32 != 0) return false;
    const int in_slice = fan_in / blocks, runs = kClusterThreads / fan_out;
    layout.in_slice[layer] = in_slice;
    layout.run[layer] = static_cast<int>(round_up(ceil_div(in_slice, runs), 4));
    layout.out_shift[layer] = log2_exact(fan_out);
    layout.slice_shift[layer] = log2_exact(fan_out / blocks);  // fan_out / blocks is a power of two
    layout.weight_offset[layer] = static_cast<int>(weight_elements);
    layout.bias_offset[layer] = static_cast<int>(bias_elements);
    weight_elements += round_up(int64_t(in_slice) * fan_out, 8);
    bias_elements += round_up(fan_out, 8);
    widest_slice = std::max(widest_slice, in_slice);
    const int64_t slice_bytes = int64_t(element_bytes) * in_slice * fan_out, bias_bytes = int64_t(element_bytes) * fan_out;
    // Every head's (and block's) slice starts 16-byte aligned when the base does and the sizes are
    // multiples of 16 bytes.
    bulk = bulk && aligned16(p.weights[layer]) && aligned16(p.biases[layer]) && slice_bytes % 16 == 0 &&
           bias_bytes % 16 == 0 && (int64_t(element_bytes) * fan_in * fan_out) % 16 == 0;
    bulk_bytes += slice_bytes + bias_bytes;
  }
  layout.in_stride = static_cast<int>(round_up(widest_slice, 4));
  layout.bias_elements = static_cast<int>(bias_elements);
  layout.bulk_bytes = bulk ? static_cast<unsigned>(bulk_bytes) : 0u;
  bytes = int64_t(sizeof(float)) * (int64_t(rows_per_block) * layout.in_stride + 3 * rows_per_block * kMaxUnits) +
          int64_t(element_bytes) * (bias_elements + weight_elements);
  return bytes <= kMaxClusterSharedBytes;
}

template <typename t, int kRows, int kBlocks>
bool launch_kernel(const ClusterLaunch& launch, int problems, size_t smem) {
  int64_t heads = 0, rows = 0;
  for (int i = 0; i < problems; ++i) {
    heads += launch.work.problems[i].heads;
    rows = std::max(rows, launch.work.problems[i].rows);
  }
  const dim3 grid(static_cast<unsigned>(heads * kBlocks), static_cast<unsigned>(ceil_div(rows, int64_t(kRows))));
  auto kernel = cluster_mlp_sign_kernel<t, t, kRows, kBlocks>;
  if (!kernel_built_for_sm90(reinterpret_cast<const void*>(kernel))) return false;
  allow_shared_memory(kernel, smem);
  KernelLaunch config(grid, dim3(kClusterThreads), smem, at::cuda::getCurrentCUDAStream());
  config.cluster(dim3(kBlocks, 1, 1));
  if (programmatic_launch_allowed(reinterpret_cast<const void*>(kernel))) config.programmatic();
  void* args[] = {const_cast<ClusterLaunch*>(&launch)};
  C10_CUDA_CHECK(cudaLaunchKernelExC(&config.config, reinterpret_cast<const void*>(kernel), args));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

template <typename t, int kBlocks>
bool launch_rows(const ClusterLaunch& launch, int problems, int rows_per_block, size_t smem) {
  switch (rows_per_block) {
    case 1: return launch_kernel<t, 1, kBlocks>(launch, problems, smem);
    case 2: return launch_kernel<t, 2, kBlocks>(launch, problems, smem);
    case 4: return launch_kernel<t, 4, kBlocks>(launch, problems, smem);
    default: return launch_kernel<t, 8, kBlocks>(launch, problems, smem);
  }
}

template <typename t>
bool launch_for_type(const ClusterLaunch& launch, int blocks, int problems, int rows_per_block, size_t smem) {
  if (blocks == 2) return launch_rows<t, 2>(launch, problems, rows_per_block, smem);
  return launch_rows<t, 4>(launch, problems, rows_per_block, smem);
}

}  // namespace

bool launch_encode_cluster(const FusedMlpLaunch& work, int problems, at::ScalarType x_type, at::ScalarType weight_type,
                           int cluster_blocks) {
  if (at::cuda::getCurrentDeviceProperties()->major < 9) return false;
  // One dtype for the inputs and the weights (a float16 or bfloat16 model): 16 instantiations.
  if ((weight_type != at::kHalf && weight_type != at::kBFloat16) || x_type != weight_type) return false;
  if (cluster_blocks != 2 && cluster_blocks != 4) return false;
  int64_t rows = 0;
  for (int i = 0; i < problems; ++i) rows = std::max(rows, work.problems[i].rows);
  // Rows per block: all of a head's rows up to 8 (their FMAs share each weight load), else groups of 8.
  const int rows_per_block = rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8;
  ClusterLaunch launch{};
  launch.work = work;
  int64_t smem = 0;
  for (int i = 0; i < problems; ++i) {
    int64_t bytes = 0;
    if (!describe_cluster_layout(work.problems[i], cluster_blocks, rows_per_block, 2, launch.layouts[i], bytes)) {
      return false;
    }
    smem = std::max(smem, bytes);
  }
  if (weight_type == at::kHalf) {
    return launch_for_type<at::Half>(launch, cluster_blocks, problems, rows_per_block, static_cast<size_t>(smem));
  }
  return launch_for_type<at::BFloat16>(launch, cluster_blocks, problems, rows_per_block, static_cast<size_t>(smem));
}

}  // namespace cuda
}  // namespace hashattention
