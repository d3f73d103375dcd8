// Host-side helpers shared by the CPU selection kernels (`hamming_topk`, `topk_from_scores`):
// reading the per-sequence tensors and writing one row of the fixed-width output.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "op_arguments.h"
#include "selection_window.h"

namespace hashattention {

class SequenceParameters {
 public:
  SequenceParameters(const std::optional<at::Tensor>& lengths, const std::optional<at::Tensor>& starts,
                     const std::optional<at::Tensor>& budgets, int64_t keys, const SelectionArgs& args)
      : lengths_(lengths ? lengths->contiguous() : at::Tensor()),
        starts_(starts ? starts->contiguous() : at::Tensor()),
        budgets_(budgets ? budgets->contiguous() : at::Tensor()),
        keys_(keys),
        args_(args) {}

  RowWindow window(int64_t b, int64_t row, int64_t rows) const {
    int64_t length = lengths_.defined() ? lengths_.data_ptr<int32_t>()[b] : keys_;
    length = std::clamp<int64_t>(length, 0, keys_);
    const int64_t start = starts_.defined() ? starts_.data_ptr<int32_t>()[b] : 0;
    int64_t budget = args_.budget;
    if (budgets_.defined()) budget = std::clamp<int64_t>(budgets_.data_ptr<int32_t>()[b], 0, args_.budget);
    return make_row_window(length, start, row, rows, args_.sink, args_.local, budget);
  }

 private:
  at::Tensor lengths_, starts_, budgets_;
  int64_t keys_;
  SelectionArgs args_;
};

// Writes sink, then the heavy positions produced by `emit_heavy(out)` (which must append
// w.heavy_budget ascending positions from [w.sink_end, w.local_begin) and return the new end),
// then the local window; pads the rest of the row with -1. Returns the count.
template <typename EmitHeavy>
int32_t write_selection_row(int32_t* out, int64_t width, const RowWindow& w, EmitHeavy emit_heavy) {
  int32_t* cursor = out;
  for (int64_t p = w.start; p < w.sink_end; ++p) *cursor++ = static_cast<int32_t>(p);
  if (w.heavy_budget == w.candidates()) {
    for (int64_t p = w.sink_end; p < w.local_begin; ++p) *cursor++ = static_cast<int32_t>(p);
  } else if (w.heavy_budget > 0) {
    cursor = emit_heavy(cursor);
  }
  for (int64_t p = w.local_begin; p < w.end; ++p) *cursor++ = static_cast<int32_t>(p);
  const int64_t count = cursor - out;
  std::fill(cursor, out + width, -1);
  return static_cast<int32_t>(count);
}

}  // namespace hashattention
