// Argument checks shared by the CPU and CUDA implementations of every op.
//
// Every check names the argument and says what was expected, so a user who passes
// a wrong tensor reads which one and why instead of a crash or a wrong answer.
// Shape/value problems raise ValueError (TORCH_CHECK_VALUE), dtype problems raise
// TypeError (TORCH_CHECK_TYPE).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "message_text.h"

namespace hashattention {

inline void check_dtype(const at::Tensor& t, at::ScalarType expected, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == expected, as_text(name), " must be ", as_text(expected), ", got ",
                   as_text(t.scalar_type()));
}

inline void check_int32(const at::Tensor& t, const char* name) {
  check_dtype(t, at::kInt, name);
}

inline void check_floating(const at::Tensor& t, const char* name) {
  const auto s = t.scalar_type();
  TORCH_CHECK_TYPE(s == at::kFloat || s == at::kHalf || s == at::kBFloat16, as_text(name),
                   " must be float32, float16 or bfloat16, got ", as_text(s));
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* name, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == dim, as_text(name), " must have ", as_text(dim), " dimensions ", as_text(layout), ", got shape ",
                    as_text(t.sizes()));
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name,
                              const char* ref_name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), as_text(name), " is on ", as_text(t.device()), " but ", as_text(ref_name),
                    " is on ", as_text(ref.device()), "; all tensors must be on the same device");
}

inline void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, as_text(name),
                    " must be contiguous in its last dimension (stride 1), got strides ",
                    as_text(t.strides()));
}

inline void check_nonempty_batch(int64_t batch, const char* name) {
  TORCH_CHECK_VALUE(batch > 0, as_text(name), " has an empty batch (size 0 in dimension 0); batch must be >= 1");
}

// An optional per-sequence int32 vector of shape (batch,) on the same device as `ref`.
inline void check_per_sequence(const std::optional<at::Tensor>& t, int64_t batch, const at::Tensor& ref,
                               const char* name, const char* ref_name) {
  if (!t.has_value()) return;
  check_int32(*t, name);
  check_same_device(*t, ref, name, ref_name);
  TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == batch, as_text(name), " must have shape (batch,) = (", as_text(batch),
                    ",), got ", as_text(t->sizes()));
}

inline bool is_supported_head_dim(int64_t d) { return d == 64 || d == 128 || d == 256; }

}  // namespace hashattention
