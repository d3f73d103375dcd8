// Allocation of op outputs.
//
// With the environment variable HASHATTENTION_POISON_OUTPUTS=1 every output is first filled
// with a poison value (NaN for floats, 0xDEADBEEF for integers), so a kernel that forgets to
// write an element fails the tests instead of passing on lucky zeroed memory. The test suite
// sets it; otherwise an output costs one getenv more than at::empty.
#pragma once

#include <ATen/ATen.h>

#include <limits>

#include "environment_overrides.h"

namespace hashattention {

inline at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor out = at::empty(sizes, options);
  if (out.numel() > 0 && environment::poison_outputs()) {
    if (at::isFloatingType(out.scalar_type())) {
      out.fill_(std::numeric_limits<double>::quiet_NaN());
    } else {
      out.fill_(static_cast<int32_t>(0xDEADBEEFu));
    }
  }
  return out;
}

}  // namespace hashattention
