// The activation between the layers of a signature MLP, applied in place through ATen (shared by
// the CPU and CUDA encoders; the names are validated by check_encode_args).
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace hashattention {

inline void apply_activation_(at::Tensor& h, const std::string& activation) {
  if (activation == "silu") {
    at::silu_(h);
  } else if (activation == "relu") {
    at::relu_(h);
  } else if (activation == "gelu") {
    h = at::gelu(h);
  } else if (activation == "tanh") {
    at::tanh_(h);
  }  // "identity": nothing to do
}

}  // namespace hashattention
