// Packing of sign bits into int32 words: bit j of word w is 1 iff value[32 * w + j] > 0.
// (Strictly greater: zero maps to 0, unlike torch.sign(0) = 0 being ambiguous.)
#pragma once

#include <cstdint>

#include "selection_window.h"  // HA_HOST_DEVICE

namespace hashattention {

template <typename T>
HA_HOST_DEVICE int32_t pack_word(const T* values) {
  uint32_t word = 0;
  for (int j = 0; j < 32; ++j) {
    word |= (static_cast<float>(values[j]) > 0.0f ? 1u : 0u) << j;
  }
  return static_cast<int32_t>(word);
}

}  // namespace hashattention
