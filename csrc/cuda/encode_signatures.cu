// CUDA kernels of `encode_signatures`, `encode_signatures_pair` (and `_into`, which stores the key
// signatures into a cache) and `pack_signs`.
//
// Encoding of few rows (a decode step: batch * tokens <= 64 per head) runs in one fused
// kernel (encode_fused.cu); encode_signatures_pair runs a decode step's query and key problems
// in one launch of it. Otherwise the per-head MLP runs as batched matrix products through
// ATen (cuBLAS): bf16 tensor-core GEMMs with split float32 activations for bf16 x and weights
// (encode_split_bf16), float32 GEMMs for the rest -- the same arithmetic as the CPU kernel, so
// bits differ only where a pre-sign value is within float32 summation-order error of 0 (split:
// ~16 significant bits of each activation) -- and the last layer's bias
// add, the sign and the packing are fused into one kernel: each warp reads 32 consecutive
// outputs (one 128-byte coalesced load) and a warp ballot turns their signs into the int32 word.
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "cuda_common.cuh"
#include "encode_fused.h"
#include "encode_heads.h"
#include "environment_overrides.h"
#include "mlp_activation.h"
#include "op_arguments.h"
#include "outputs.h"

namespace hashattention {
namespace cuda {
namespace {

// values: contiguous (rows, bits); bias: contiguous (heads, bits) or nullptr, where the row
// r belongs to head (r / tokens) % heads. out: (rows, bits / 32).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    sign_pack_kernel(const scalar_t* __restrict__ values, const float* __restrict__ bias, int32_t* __restrict__ out,
                     int64_t words_total, int64_t bits, int64_t tokens, int64_t heads) {
  const int lane = threadIdx.x & 31;
  const int64_t warps_total = int64_t(gridDim.x) * kWarps;
  for (int64_t word = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); word < words_total; word += warps_total) {
    const int64_t element = word * 32 + lane;
    // Compare in float like the CPU kernel (a tiny positive double rounds to 0 -> bit 0).
    float v = static_cast<float>(values[element]);
    if (bias != nullptr) {
      const int64_t row = element / bits;
      v += bias[((row / tokens) % heads) * bits + element % bits];
    }
    const unsigned bits_word = __ballot_sync(0xffffffffu, v > 0.0f);  // NaN > 0 is false: bit 0
    if (lane == 0) out[word] = static_cast<int32_t>(bits_word);
  }
}

// dst[b, h, positions[n], w] = src[b, h, n, w] for src contiguous int32 (B, H, N, W) and dst int32
// (B, H, S, W) of any strides; slots outside [0, S) are skipped (they cannot be reported without a
// host sync). One thread per word.
__global__ void __launch_bounds__(kThreads)
    store_rows_kernel(const int32_t* __restrict__ src, int32_t* __restrict__ dst, const int64_t* __restrict__ positions,
                      int64_t total, int64_t heads, int64_t tokens, int64_t words, int64_t slots, int64_t ds0,
                      int64_t ds1, int64_t ds2, int64_t ds3) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < total; i += int64_t(gridDim.x) * kThreads) {
    const int64_t w = i % words, n = (i / words) % tokens, h = (i / (words * tokens)) % heads;
    const int64_t b = i / (words * tokens * heads);
    const int64_t slot = positions[n];
    if (slot >= 0 && slot < slots) dst[b * ds0 + h * ds1 + slot * ds2 + w * ds3] = src[i];
  }
}

void store_rows(const at::Tensor& src, at::Tensor& dst, const at::Tensor& positions) {
  const int64_t total = src.numel();
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>(ceil_div(total, kThreads), int64_t(multiprocessor_count()) * 16);
  store_rows_kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      src.data_ptr<int32_t>(), dst.data_ptr<int32_t>(), positions.data_ptr<int64_t>(), total, src.size(1),
      src.size(2), src.size(3), dst.size(2), dst.stride(0), dst.stride(1), dst.stride(2), dst.stride(3));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_sign_pack(const at::Tensor& values, const at::Tensor& bias, at::Tensor& out, int64_t bits,
                      int64_t tokens, int64_t heads) {
  const int64_t words_total = out.numel();
  if (words_total == 0) return;
  const int64_t blocks = std::min<int64_t>(ceil_div(words_total, kWarps), int64_t(multiprocessor_count()) * 16);
  const float* bias_data = bias.defined() ? bias.data_ptr<float>() : nullptr;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "sign_pack_cuda", [&] {
    sign_pack_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(values.data_ptr<scalar_t>(), bias_data,
                                                                out.data_ptr<int32_t>(), words_total, bits,
                                                                tokens, heads);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor pack_signs_cuda(const at::Tensor& values) {
  const int64_t bits = check_pack_args(values);
  const c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor contiguous = values.contiguous();
  auto out_shape = values.sizes().vec();
  out_shape.back() = bits / 32;
  at::Tensor out = new_output(out_shape, values.options().dtype(at::kInt));
  launch_sign_pack(contiguous, at::Tensor(), out, bits, 1, 1);
  return out;
}

namespace {

// The cuBLAS path of one encoder problem (prefill-sized inputs): x (B, H, N, D) one x head per
// MLP head, written into out (B, H, N, words).
void encode_batched_matmul(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                           const std::string& activation, const EncodeDims& dims, at::Tensor& out) {
  at::Tensor h = x.to(at::kFloat);  // (B, H, N, in)
  const size_t layers = weights.size();
  for (size_t i = 0; i < layers; ++i) {
    h = at::matmul(h, weights[i].to(at::kFloat).unsqueeze(0));  // (B, H, N, out_i)
    if (i + 1 < layers) {
      h.add_(biases[i].to(at::kFloat).unsqueeze(0).unsqueeze(2));
      apply_activation_(h, activation);
    }
  }
  h = h.contiguous();
  const at::Tensor last_bias = biases[layers - 1].to(at::kFloat).contiguous();  // added in the pack kernel
  launch_sign_pack(h, last_bias, out, dims.bits, dims.tokens, dims.heads);
}

// The tensor-core path of prefill-sized problems with bfloat16 x and weights (a bf16 model's prompt:
// every key of a 128K-token prompt per layer). The float32 products of encode_batched_matmul ran on
// the CUDA cores and their float32 copies dominated a patched model's prefill (H200, 128K tokens,
// 32 per-query-head key MLPs: ~0.67 s over 32 layers). Here every product is a bf16 GEMM with float32
// accumulation and output: x and the weights are exact in bf16, and each float32 activation a enters
// as hi = bf16(a) and lo = bf16(a - hi), one GEMM each -- the split of the tensor-core decode kernel
// (encode_mma.cu), so the products carry ~16 significant bits of a, within the encoder tests' margin.
// Tokens go in chunks of at most kSplitChunkRows rows over all heads, which bounds the float32
// intermediates (512 MB at width 128) whatever the prompt length.
constexpr int64_t kSplitChunkRows = int64_t(1) << 20;

bool split_bf16_applies(const at::Tensor& x, at::TensorList weights, at::TensorList biases) {
  if (x.scalar_type() != at::kBFloat16) return false;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (weights[i].scalar_type() != at::kBFloat16 || biases[i].scalar_type() != at::kBFloat16) return false;
  }
  return true;
}

void encode_split_bf16(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                       const std::string& activation, const EncodeDims& dims, at::Tensor& out) {
  const int64_t batch = x.size(0), tokens = x.size(2), heads = dims.heads;
  const int64_t chunk = std::max<int64_t>(1, kSplitChunkRows / std::max<int64_t>(1, heads * batch));
  const size_t layers = weights.size();
  std::vector<at::Tensor> hidden_biases;  // (H, 1, out_i) float32, added between the products
  for (size_t i = 0; i + 1 < layers; ++i) hidden_biases.push_back(biases[i].to(at::kFloat).unsqueeze(1));
  const at::Tensor last_bias = biases[layers - 1].to(at::kFloat).contiguous();  // added in the pack kernel
  for (int64_t start = 0; start < tokens; start += chunk) {
    const int64_t n = std::min(chunk, tokens - start);
    // (H, B * n, D): head-major rows, one batched GEMM per layer over all heads.
    const at::Tensor rows =
        repeat_x_heads(x.narrow(2, start, n), heads).transpose(0, 1).reshape({heads, batch * n, x.size(3)});
    at::Tensor h = at::bmm(rows, weights[0], at::kFloat);
    for (size_t i = 1; i < layers; ++i) {
      h.add_(hidden_biases[i - 1]);
      apply_activation_(h, activation);
      const at::Tensor hi = h.to(at::kBFloat16);
      const at::Tensor lo = h.sub_(hi.to(at::kFloat)).to(at::kBFloat16);
      h = at::baddbmm(at::bmm(hi, weights[i], at::kFloat), lo, weights[i], at::kFloat);
    }
    // Row r of h belongs to head r / (B * n); pack, then scatter (H, B, n) into out's (B, H, N).
    at::Tensor packed = at::empty({heads, batch * n, dims.words}, out.options());
    launch_sign_pack(h, last_bias, packed, dims.bits, batch * n, heads);
    out.narrow(2, start, n).copy_(packed.view({heads, batch, n, dims.words}).transpose(0, 1));
  }
}

// One encoder problem, validated: x (B, Hx, N, D) with Hx dividing the MLP heads. Few rows go
// through the fused kernel (which maps heads itself), the rest through cuBLAS: bf16 GEMMs for
// bf16 x and weights, float32 ones otherwise, on a copy of x with one head per MLP head.
at::Tensor encode_problem(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                          const std::string& activation, const EncodeDims& dims) {
  at::Tensor out = new_output({dims.batch, dims.heads, dims.tokens, dims.words}, x.options().dtype(at::kInt));
  if (fused_encode_applies(x, weights, biases)) {
    encode_fused_cuda(x, weights, biases, activation, out);
  } else if (split_bf16_applies(x, weights, biases)) {
    encode_split_bf16(x, weights, biases, activation, dims, out);
  } else {
    encode_batched_matmul(repeat_x_heads(x, dims.heads), weights, biases, activation, dims, out);
  }
  return out;
}

}  // namespace

at::Tensor encode_signatures_cuda(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                                  c10::string_view activation_view) {
  const std::string activation(activation_view);
  const EncodeDims dims = check_encode_args(x, weights.vec(), biases.vec(), activation);
  const c10::cuda::CUDAGuard guard(x.device());
  return encode_problem(x, weights, biases, activation, dims);
}

// A decode step's query rows and new key rows: one fused launch when both qualify and share
// dtypes (the common case), else each problem on its own path.
std::tuple<at::Tensor, at::Tensor> encode_signatures_pair_cuda(
    const at::Tensor& query, at::TensorList query_weights, at::TensorList query_biases, const at::Tensor& key,
    at::TensorList key_weights, at::TensorList key_biases, c10::string_view activation_view) {
  const std::string activation(activation_view);
  const EncodePairDims dims = check_encode_pair_args(query, query_weights.vec(), query_biases.vec(), key,
                                                     key_weights.vec(), key_biases.vec(), activation);
  const c10::cuda::CUDAGuard guard(query.device());
  if (!fused_encode_pair_applies(query, query_weights, query_biases, key, key_weights, key_biases)) {
    return {encode_problem(query, query_weights, query_biases, activation, dims.query),
            encode_problem(key, key_weights, key_biases, activation, dims.key)};
  }
  const auto int_options = query.options().dtype(at::kInt);
  at::Tensor query_out = new_output({dims.query.batch, dims.query.heads, dims.query.tokens, dims.query.words}, int_options);
  at::Tensor key_out = new_output({dims.key.batch, dims.key.heads, dims.key.tokens, dims.key.words}, int_options);
  encode_fused_pair_cuda(query, query_weights, query_biases, query_out, key, key_weights, key_biases, key_out,
                         activation);
  return {query_out, key_out};
}

// The pair with the key signatures stored into a cache at `positions` (device values, not checked:
// slots outside [0, S) are skipped). The fused launch writes them in place; other paths encode the
// keys into a temporary and store its rows.
at::Tensor encode_signatures_pair_into_cuda(const at::Tensor& query, at::TensorList query_weights,
                                            at::TensorList query_biases, const at::Tensor& key,
                                            at::TensorList key_weights, at::TensorList key_biases,
                                            at::Tensor& key_signatures, const at::Tensor& positions,
                                            c10::string_view activation_view) {
  const std::string activation(activation_view);
  const EncodePairDims dims =
      check_encode_pair_into_args(query, query_weights.vec(), query_biases.vec(), key, key_weights.vec(),
                                  key_biases.vec(), key_signatures, positions, activation);
  const c10::cuda::CUDAGuard guard(query.device());
  if (environment::encoder_choice() == environment::EncoderChoice::kSkip) {  // no launch, output unwritten
    return new_output({dims.query.batch, dims.query.heads, dims.query.tokens, dims.query.words},
                      query.options().dtype(at::kInt));
  }
  if (fused_encode_pair_applies(query, query_weights, query_biases, key, key_weights, key_biases) &&
      (key_signatures.size(3) == 1 || key_signatures.stride(3) == 1)) {
    at::Tensor query_out = new_output({dims.query.batch, dims.query.heads, dims.query.tokens, dims.query.words},
                                      query.options().dtype(at::kInt));
    encode_fused_pair_cuda(query, query_weights, query_biases, query_out, key, key_weights, key_biases,
                           key_signatures, activation, positions);
    return query_out;
  }
  at::Tensor query_out = encode_problem(query, query_weights, query_biases, activation, dims.query);
  const at::Tensor key_out = encode_problem(key, key_weights, key_biases, activation, dims.key);
  store_rows(key_out, key_signatures, positions);
  return query_out;
}

}  // namespace cuda

TORCH_LIBRARY_IMPL(hashattention, CUDA, m) {
  m.impl("encode_signatures", &cuda::encode_signatures_cuda);
  m.impl("encode_signatures_pair", &cuda::encode_signatures_pair_cuda);
  m.impl("encode_signatures_pair_into", &cuda::encode_signatures_pair_into_cuda);
  m.impl("pack_signs", &cuda::pack_signs_cuda);
}

}  // namespace hashattention
