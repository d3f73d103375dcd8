// The budget contract shared by every selection kernel (CPU and CUDA).
//
// For one query row the selected set is
//   sink  window: [start, sink_end)            -- the first `sink` tokens from the start offset
//   heavy tokens: the best `heavy_budget` of [sink_end, local_begin) by score
//   local window: [local_begin, position + 1)  -- the latest `local` tokens up to the row itself
// Row l of a chunk of L rows sits at position length - L + l (causal: it sees only <= itself).
// Positions before `start` (left padding) are never selected; windows count from `start`.
// Because the three ranges are disjoint and ordered, writing sink, then heavy (in position
// order), then local yields position-sorted output.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__CUDACC__)
#define HA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define HA_HOST_DEVICE inline
#endif

namespace hashattention {

struct RowWindow {
  int64_t start;         // first selectable position
  int64_t sink_end;      // sink window is [start, sink_end)
  int64_t local_begin;   // heavy candidates are [sink_end, local_begin)
  int64_t end;           // local window is [local_begin, end); end = row position + 1
  int64_t heavy_budget;  // how many heavy tokens to take (<= candidates)

  HA_HOST_DEVICE int64_t candidates() const { return local_begin - sink_end; }
  HA_HOST_DEVICE int64_t count() const {
    return (sink_end - start) + heavy_budget + (end - local_begin);
  }
};

// `length` is the number of valid tokens of the sequence (already clamped to [0, N]),
// `start` its left-padding offset, `budget` the heavy budget for this sequence
// (already min(static budget, per-sequence budget)), `row`/`rows` the query row in its chunk.
HA_HOST_DEVICE RowWindow make_row_window(int64_t length, int64_t start, int64_t row, int64_t rows,
                                         int64_t sink, int64_t local, int64_t budget) {
  RowWindow w;
  const int64_t position = length - rows + row;
  w.start = start < 0 ? 0 : start;
  w.end = position + 1;
  if (w.end <= w.start) {  // the row sits in the padding (or before the sequence): selects nothing
    w.end = w.start;
    w.sink_end = w.start;
    w.local_begin = w.start;
    w.heavy_budget = 0;
    return w;
  }
  w.sink_end = std::min(w.start + sink, w.end);
  w.local_begin = std::max(w.end - local, w.sink_end);
  const int64_t candidates = w.local_begin - w.sink_end;
  const int64_t b = budget < 0 ? 0 : budget;
  w.heavy_budget = b < candidates ? b : candidates;
  return w;
}

}  // namespace hashattention
