// Fused encoder for few rows: the whole per-head MLP, the sign and the packing in one kernel.
//
// A decode step encodes one new query and one new key row per head and sequence. Through ATen
// that is a chain of ~10 small kernels per call (dtype casts of the input and the weights,
// one batched matmul per layer, bias adds, the activation, the sign-and-pack kernel), each a
// few microseconds of launch latency inside a CUDA graph. Here one block per (head, group of
// up to kRowsPerBlock rows) keeps the rows' activations in shared memory, reads each weight
// matrix once in its own dtype (a thread per output unit, coalesced across the units) and
// accumulates in float32 in input order, like the CPU kernel; the last layer's signs become
// int32 words through warp ballots. Larger inputs (prefill) stay on the cuBLAS path, where the
// matrix products run on tensor cores.
#include "encode_fused.h"

#include <algorithm>

#include "cuda_common.cuh"

namespace hashattention {
namespace cuda {
namespace {

constexpr int kRowsPerBlock = 8;    // rows of one head scored together (accumulators per thread)
constexpr int kMaxLayers = 8;
constexpr int64_t kMaxWidth = 1024;  // widest layer kept in shared memory
constexpr int64_t kMaxRows = 64;     // rows per head (batch * tokens) up to which the fused path runs

enum Activation : int { kSilu = 0, kRelu = 1, kGelu = 2, kTanh = 3, kIdentity = 4 };

struct FusedMlpParams {
  const void* x;
  int64_t xs0, xs1, xs2, xs3;  // strides of x (B, H, N, D), any layout
  int64_t tokens, rows;         // N and B * N
  int layers;
  int widths[kMaxLayers + 1];  // widths[0] = D, widths[i + 1] = out_features of layer i
  const void* weights[kMaxLayers];  // contiguous (H, in, out)
  const void* biases[kMaxLayers];   // contiguous (H, out)
  int64_t width_stride;              // floats per row in each shared-memory buffer
  int activation;
  int32_t* out;  // contiguous (B, H, N, words)
  int64_t heads;
};

__device__ __forceinline__ float activate(float v, int activation) {
  switch (activation) {
    case kSilu: return v / (1.0f + expf(-v));
    case kRelu: return v > 0.0f ? v : 0.0f;
    case kGelu: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));  // exact (erf) GELU, as at::gelu
    case kTanh: return tanhf(v);
    default: return v;
  }
}

template <typename x_t, typename w_t>
__global__ void __launch_bounds__(kThreads) fused_mlp_sign_kernel(FusedMlpParams p) {
  extern __shared__ float buffers[];  // two buffers of kRowsPerBlock * width_stride floats
  const int64_t h = blockIdx.x;
  const int64_t row0 = int64_t(blockIdx.y) * kRowsPerBlock;
  const int rows = static_cast<int>(min64(kRowsPerBlock, p.rows - row0));
  float* in = buffers;
  float* next = buffers + kRowsPerBlock * p.width_stride;

  const x_t* x = static_cast<const x_t*>(p.x);
  const int d = p.widths[0];
  for (int i = threadIdx.x; i < rows * d; i += kThreads) {
    const int r = i / d, k = i % d;
    const int64_t row = row0 + r, b = row / p.tokens, n = row % p.tokens;
    in[r * p.width_stride + k] = static_cast<float>(x[b * p.xs0 + h * p.xs1 + n * p.xs2 + k * p.xs3]);
  }
  for (int i = threadIdx.x; i < (kRowsPerBlock - rows) * d; i += kThreads) {  // unused rows: zeros
    in[(rows + i / d) * p.width_stride + i % d] = 0.0f;
  }
  __syncthreads();

  const int lane = threadIdx.x & 31;
  for (int layer = 0; layer < p.layers; ++layer) {
    const int fan_in = p.widths[layer], fan_out = p.widths[layer + 1];
    const bool last = layer + 1 == p.layers;
    const w_t* w = static_cast<const w_t*>(p.weights[layer]) + h * fan_in * fan_out;
    const w_t* bias = static_cast<const w_t*>(p.biases[layer]) + h * fan_out;
    // The last layer's width is a multiple of 32, so every warp of its loop is full (ballots).
    for (int j = threadIdx.x; j < fan_out; j += kThreads) {
      float acc[kRowsPerBlock];
#pragma unroll
      for (int r = 0; r < kRowsPerBlock; ++r) acc[r] = 0.0f;
#pragma unroll 8
      for (int k = 0; k < fan_in; ++k) {
        const float wk = static_cast<float>(w[k * fan_out + j]);
#pragma unroll
        for (int r = 0; r < kRowsPerBlock; ++r) acc[r] = fmaf(in[r * p.width_stride + k], wk, acc[r]);
      }
      const float bj = static_cast<float>(bias[j]);
      if (!last) {
#pragma unroll
        for (int r = 0; r < kRowsPerBlock; ++r) {
          next[r * p.width_stride + j] = r < rows ? activate(acc[r] + bj, p.activation) : 0.0f;
        }
      } else {
        const int64_t words = fan_out / 32;
#pragma unroll
        for (int r = 0; r < kRowsPerBlock; ++r) {
          // Compare in float like the CPU kernel; NaN > 0 is false: bit 0.
          const unsigned word = __ballot_sync(0xffffffffu, acc[r] + bj > 0.0f);
          if (lane == 0 && r < rows) {
            const int64_t row = row0 + r, b = row / p.tokens, n = row % p.tokens;
            p.out[((b * p.heads + h) * p.tokens + n) * words + j / 32] = static_cast<int32_t>(word);
          }
        }
      }
    }
    __syncthreads();
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

template <typename x_t>
void launch_for_input(const FusedMlpParams& p, at::ScalarType weight_type, dim3 grid, size_t smem) {
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight_type, "encode_fused_cuda", [&] {
    auto kernel = fused_mlp_sign_kernel<x_t, scalar_t>;
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    }
    kernel<<<grid, kThreads, smem, stream>>>(p);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool fused_encode_applies(const at::Tensor& x, at::TensorList weights, at::TensorList biases) {
  if (x.size(0) * x.size(2) > kMaxRows || weights.size() > size_t(kMaxLayers)) return false;
  const at::ScalarType weight_type = weights[0].scalar_type();
  if (x.size(3) > kMaxWidth) return false;
  for (size_t i = 0; i < weights.size(); ++i) {
    // One weight dtype for every layer and bias keeps the instantiations to 3 x 3.
    if (weights[i].scalar_type() != weight_type || biases[i].scalar_type() != weight_type) return false;
    if (weights[i].size(2) > kMaxWidth) return false;
  }
  return true;
}

void encode_fused_cuda(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                       const std::string& activation, at::Tensor& out) {
  const int64_t rows = x.size(0) * x.size(2);
  if (rows == 0 || x.size(1) == 0) return;
  FusedMlpParams p{};
  p.x = x.data_ptr();
  p.xs0 = x.stride(0), p.xs1 = x.stride(1), p.xs2 = x.stride(2), p.xs3 = x.stride(3);
  p.tokens = x.size(2), p.rows = rows, p.heads = x.size(1);
  p.layers = static_cast<int>(weights.size());
  p.widths[0] = static_cast<int>(x.size(3));
  // The weights are usually contiguous already (no copy); .contiguous() keeps any view correct.
  std::vector<at::Tensor> kept;
  kept.reserve(2 * weights.size());
  int64_t widest = x.size(3);
  for (size_t i = 0; i < weights.size(); ++i) {
    kept.push_back(weights[i].contiguous());
    kept.push_back(biases[i].contiguous());
    p.weights[i] = kept[2 * i].data_ptr();
    p.biases[i] = kept[2 * i + 1].data_ptr();
    p.widths[i + 1] = static_cast<int>(weights[i].size(2));
    widest = std::max<int64_t>(widest, weights[i].size(2));
  }
  p.width_stride = widest;
  p.activation = activation_code(activation);
  p.out = out.data_ptr<int32_t>();
  const size_t smem = sizeof(float) * 2 * kRowsPerBlock * size_t(widest);
  const dim3 grid(static_cast<unsigned>(x.size(1)), static_cast<unsigned>(ceil_div(rows, int64_t(kRowsPerBlock))));
  const at::ScalarType weight_type = weights[0].scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "encode_fused_cuda_input", [&] {
    launch_for_input<scalar_t>(p, weight_type, grid, smem);
  });
}

}  // namespace cuda
}  // namespace hashattention
