// Text of error-message arguments, formatted without iostreams.
//
// Why: an extension built with a C++ toolchain other than the one whose libstdc++ the process
// loads (seen on a GPU image whose default compiler was a separately installed GCC) crashed
// inside std::ostream whenever a TORCH_CHECK message formatted a *number*; strings were fine.
// Every non-literal argument of our TORCH_CHECK messages goes through as_text(), which turns
// numbers, shapes, devices and dtypes into std::string / const char* with std::to_string, so an
// error is always an exception with a message, never a crash.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <type_traits>

namespace hashattention {

inline const char* as_text(const char* text) { return text; }
inline const std::string& as_text(const std::string& text) { return text; }
inline const char* as_text(at::ScalarType dtype) { return c10::toString(dtype); }
inline std::string as_text(const at::Device& device) { return device.str(); }

template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
std::string as_text(T value) {
  return std::to_string(value);
}

inline std::string as_text(at::IntArrayRef values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(values[i]);
  }
  return text + "]";
}

}  // namespace hashattention
