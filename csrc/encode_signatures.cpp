// CPU kernels of `encode_signatures` (per-head MLP -> sign -> packed bits), `encode_signatures_pair`
// (a decode step's query and key problems in one call) and `pack_signs`.
//
// The MLP is a handful of batched matrix products, so the CPU version runs them through
// ATen in float32 (oneDNN/OpenBLAS do that well); the part written here is the sign-and-pack
// step, parallel over rows.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "checks.h"
#include "encode_heads.h"
#include "outputs.h"
#include "mlp_activation.h"
#include "op_arguments.h"
#include "signature_packing.h"

namespace hashattention {

namespace {


// values: contiguous (rows, bits) -> int32 (rows, bits / 32)
at::Tensor pack_rows_cpu(const at::Tensor& values, int64_t rows, int64_t bits) {
  const int64_t words = bits / 32;
  at::Tensor out = new_output({rows, words}, values.options().dtype(at::kInt));
  if (rows == 0) return out;
  int32_t* dst = out.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "pack_signs_cpu", [&] {
    const scalar_t* src = values.data_ptr<scalar_t>();
    at::parallel_for(0, rows * words, 2048, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) dst[i] = pack_word(src + i * 32);
    });
  });
  return out;
}

}  // namespace

at::Tensor pack_signs_cpu(const at::Tensor& values) {
  const int64_t bits = check_pack_args(values);
  const at::Tensor contiguous = values.contiguous();
  const int64_t rows = bits == 0 ? 0 : contiguous.numel() / bits;
  auto out_shape = values.sizes().vec();
  out_shape.back() = bits / 32;
  return pack_rows_cpu(contiguous, rows, bits).view(out_shape);
}

at::Tensor encode_signatures_cpu(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                                 c10::string_view activation_view) {
  const std::string activation(activation_view);
  const EncodeDims dims = check_encode_args(x, weights.vec(), biases.vec(), activation);
  at::Tensor h = x.to(at::kFloat);  // (B, H, N, in)
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor w = weights[i].to(at::kFloat).unsqueeze(0);              // (1, H, in, out)
    const at::Tensor b = biases[i].to(at::kFloat).unsqueeze(0).unsqueeze(2);  // (1, H, 1, out)
    h = at::matmul(h, w).add_(b);
    if (i + 1 < weights.size()) apply_activation_(h, activation);
  }
  h = h.contiguous();
  const int64_t rows = dims.batch * dims.heads * dims.tokens;
  return pack_rows_cpu(h, rows, dims.bits).view({dims.batch, dims.heads, dims.tokens, dims.words});
}

// On the CPU the pair is just two encodes (one call saves nothing here); the key's heads are
// mapped onto the key MLP heads by a copy.
std::tuple<at::Tensor, at::Tensor> encode_signatures_pair_cpu(const at::Tensor& query, at::TensorList query_weights,
                                                              at::TensorList query_biases, const at::Tensor& key,
                                                              at::TensorList key_weights, at::TensorList key_biases,
                                                              c10::string_view activation) {
  const EncodePairDims dims = check_encode_pair_args(query, query_weights.vec(), query_biases.vec(), key,
                                                     key_weights.vec(), key_biases.vec(), std::string(activation));
  return {encode_signatures_cpu(query, query_weights, query_biases, activation),
          encode_signatures_cpu(repeat_x_heads(key, dims.key.heads), key_weights, key_biases, activation)};
}

// The pair with the key signatures stored into the cache at `positions` (checked here: on the CPU
// the values can be read without a sync).
at::Tensor encode_signatures_pair_into_cpu(const at::Tensor& query, at::TensorList query_weights,
                                           at::TensorList query_biases, const at::Tensor& key,
                                           at::TensorList key_weights, at::TensorList key_biases,
                                           at::Tensor& key_signatures, const at::Tensor& positions,
                                           c10::string_view activation) {
  check_encode_pair_into_args(query, query_weights.vec(), query_biases.vec(), key, key_weights.vec(),
                              key_biases.vec(), key_signatures, positions, std::string(activation));
  check_store_positions_cpu(positions, key_signatures.size(2));
  auto [query_out, key_out] =
      encode_signatures_pair_cpu(query, query_weights, query_biases, key, key_weights, key_biases, activation);
  key_signatures.index_copy_(2, positions, key_out);
  return query_out;
}

TORCH_LIBRARY_IMPL(hashattention, CPU, m) {
  m.impl("encode_signatures", &encode_signatures_cpu);
  m.impl("encode_signatures_pair", &encode_signatures_pair_cpu);
  m.impl("encode_signatures_pair_into", &encode_signatures_pair_into_cpu);
  m.impl("pack_signs", &pack_signs_cpu);
}

}  // namespace hashattention
