// CUDA kernels of `hamming_topk` and `topk_from_scores`: exact top-k selection with the
// sink/local budget contract of selection_window.h, identical to the CPU kernels (same set,
// same order, ties to the later position, -1 padding, counts).
//
// Fast path of hamming_topk (a row's scores take only max_score + 1 <= kFastBins values):
// the row is split into chunks so that even batch 1 fills the GPU, and three kernels run:
//   1. histogram: each (row, chunk) block scores its chunk and writes the chunk's histogram;
//   2. threshold: one block per row sums the chunk histograms, finds the threshold score T
//      (the largest with count(score >= T) >= m), how many of the ties at T to skip (the
//      earliest ones), and for each chunk where its selected entries start; it also writes
//      the sink and local windows, the padding and the count;
//   3. compaction: each (row, chunk) block scores its chunk again (the signatures are
//      L2-hot) and writes its selected positions in order.
// No score tensor is written and nothing is sorted. Every other case (larger score ranges,
// and topk_from_scores for any dtype) runs one block per row: an exact radix select over
// order-preserving keys, 8 bits per pass, then the same ordered compaction.
#include <torch/library.h>

#include <tuple>

#include "checks.h"
#include "cuda_common.cuh"
#include "op_arguments.h"
#include "outputs.h"
#include "selection_sources.cuh"

namespace hashattention {
namespace cuda {
namespace {

constexpr int kItems = 4;                        // elements per thread per tile
constexpr int64_t kTile = int64_t(kItems) * kThreads;
constexpr int64_t kFastBins = 2049;              // score ranges the histogram path handles
constexpr int64_t kMaxChunks = 4096;

struct ChunkLayout {
  int64_t chunk;   // candidates per chunk (multiple of kTile)
  int64_t chunks;  // chunks per row (grid dimension)
  int64_t bins;
};

// Workspace of the fast path (int32): per row, chunks x bins histograms, then per chunk
// (output offset, ties to skip), then per row (mode, threshold).
struct FastWorkspace {
  int32_t* histograms;
  int32_t* chunk_info;
  int32_t* row_info;
};

enum RowMode : int32_t { kNothing = 0, kAll = 1, kPartial = 2 };

__device__ __forceinline__ void row_coordinates(const SelectionParams& p, int64_t row, int64_t& b, int64_t& s,
                                                int64_t& l) {
  l = row % p.rows;
  s = (row / p.rows) % p.heads;
  b = row / (p.rows * p.heads);
}

// ---- fast path, kernel 1: chunk histograms --------------------------------------------------
__global__ void __launch_bounds__(kThreads)
    hamming_histogram_kernel(SelectionParams p, HammingSource src, ChunkLayout layout, FastWorkspace ws) {
  extern __shared__ int32_t smem[];
  int32_t* histogram = smem;
  int32_t* q_words = smem + layout.bins;
  const int64_t row = blockIdx.x, chunk = blockIdx.y;
  int64_t b, s, l;
  row_coordinates(p, row, b, s, l);
  const RowWindow w = p.window(b, l);
  const int64_t n = w.candidates();
  if (w.heavy_budget == 0 || w.heavy_budget == n) return;
  const int64_t begin = chunk * layout.chunk;
  if (begin >= n) return;
  const int64_t size = min(layout.chunk, n - begin);

  for (int64_t v = threadIdx.x; v < layout.bins; v += kThreads) histogram[v] = 0;
  src.prepare(b, s, l, q_words);  // ends with a barrier
  const int64_t first = w.sink_end + begin;
  for (int64_t tile = 0; tile < size; tile += kTile) {
    int32_t score[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t i = tile + k * kThreads + threadIdx.x;
      score[k] = i < size ? src.score(first + i) : -1;
    }
    // Scores cluster on a few values, so plain shared atomics from a warp would serialise on
    // the same addresses: lanes holding equal scores elect one of them to add their count.
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const unsigned peers = __match_any_sync(0xffffffffu, score[k]);
      if (score[k] >= 0 && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&histogram[score[k]], __popc(peers));
    }
  }
  __syncthreads();
  int32_t* out = ws.histograms + (row * layout.chunks + chunk) * layout.bins;
  for (int64_t v = threadIdx.x; v < layout.bins; v += kThreads) out[v] = histogram[v];
}

// ---- fast path, kernel 2: threshold and chunk offsets ---------------------------------------
__global__ void __launch_bounds__(kThreads)
    hamming_threshold_kernel(SelectionParams p, ChunkLayout layout, FastWorkspace ws) {
  extern __shared__ int32_t smem[];
  int32_t* histogram = smem;                          // bins
  int32_t* chunk_better = smem + layout.bins;         // chunks
  int32_t* chunk_ties = chunk_better + layout.chunks;  // chunks
  __shared__ int64_t scan_scratch[kWarps];
  __shared__ int64_t found[2];

  const int64_t row = blockIdx.x;
  int64_t b, s, l;
  row_coordinates(p, row, b, s, l);
  const RowWindow w = p.window(b, l);
  write_fixed_part_of_row(p, row, w);
  const int64_t n = w.candidates(), m = w.heavy_budget;
  int32_t* info = ws.row_info + row * 2;
  if (m == 0 || m == n) {
    if (threadIdx.x == 0) info[0] = m == 0 ? kNothing : kAll;
    return;
  }
  const int64_t chunks = ceil_div(n, layout.chunk);
  const int64_t bins = layout.bins;
  const int32_t* hist_base = ws.histograms + row * layout.chunks * bins;

  for (int64_t v = threadIdx.x; v < bins; v += kThreads) {
    int32_t total = 0;
    for (int64_t c = 0; c < chunks; ++c) total += hist_base[c * bins + v];
    histogram[v] = total;
  }
  __syncthreads();

  // Threshold: thread t owns the t-th segment of bins counted from the top, so an exclusive
  // scan over threads gives the number of candidates scoring above its segment.
  const int64_t per_thread = ceil_div(bins, kThreads);
  const int64_t hi = bins - int64_t(threadIdx.x) * per_thread;  // segment is [lo, hi)
  const int64_t lo = max64(hi - per_thread, 0);
  int64_t segment = 0;
  for (int64_t v = lo; v < hi; ++v) segment += histogram[v];
  int64_t total;
  int64_t above = block_exclusive_scan(hi > 0 ? segment : 0, scan_scratch, total);
  for (int64_t v = hi - 1; v >= lo; --v) {
    if (above < m && above + histogram[v] >= m) {
      found[0] = v;
      found[1] = above;
    }
    above += histogram[v];
  }
  __syncthreads();
  const int64_t threshold = found[0];
  const int64_t skip = histogram[threshold] - (m - found[1]);  // earliest ties at T are dropped

  // Per chunk: candidates above T and ties at T.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int64_t c = warp; c < chunks; c += kWarps) {
    const int32_t* h = hist_base + c * bins;
    int32_t better = 0;
    for (int64_t v = threshold + 1 + lane; v < bins; v += 32) better += h[v];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) better += __shfl_xor_sync(0xffffffffu, better, offset);
    if (lane == 0) {
      chunk_better[c] = better;
      chunk_ties[c] = h[threshold];
    }
  }
  __syncthreads();

  // Exclusive scans over chunks (each thread a contiguous run of chunks): ties before each
  // chunk give its ties to skip, selected entries before it give its output offset.
  const int64_t per = ceil_div(chunks, kThreads);
  const int64_t c0 = min64(int64_t(threadIdx.x) * per, chunks), c1 = min64(c0 + per, chunks);
  int64_t ties_sum = 0;
  for (int64_t c = c0; c < c1; ++c) ties_sum += chunk_ties[c];
  int64_t ties_before = block_exclusive_scan(ties_sum, scan_scratch, total);
  int64_t selected_sum = 0;
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t ties = chunk_ties[c];
    const int64_t chunk_skip = min64(max64(skip - ties_before, 0), ties);
    ties_before += ties;
    chunk_ties[c] = static_cast<int32_t>(chunk_skip);  // reuse: now the chunk's ties to skip
    chunk_better[c] += static_cast<int32_t>(ties - chunk_skip);  // now the chunk's selected count
    selected_sum += chunk_better[c];
  }
  int64_t selected_before = block_exclusive_scan(selected_sum, scan_scratch, total);
  const int64_t sink_count = w.sink_end - w.start;
  int32_t* chunk_info = ws.chunk_info + row * layout.chunks * 2;
  for (int64_t c = c0; c < c1; ++c) {
    chunk_info[2 * c] = static_cast<int32_t>(sink_count + selected_before);
    chunk_info[2 * c + 1] = chunk_ties[c];
    selected_before += chunk_better[c];
  }
  if (threadIdx.x == 0) {
    info[0] = kPartial;
    info[1] = static_cast<int32_t>(threshold);
  }
}

// ---- fast path, kernel 3: ordered compaction per chunk --------------------------------------
__global__ void __launch_bounds__(kThreads)
    hamming_compact_kernel(SelectionParams p, HammingSource src, ChunkLayout layout, FastWorkspace ws) {
  extern __shared__ int32_t smem[];
  __shared__ int table[kItems * kWarps];
  const int64_t row = blockIdx.x, chunk = blockIdx.y;
  int64_t b, s, l;
  row_coordinates(p, row, b, s, l);
  const RowWindow w = p.window(b, l);
  const int64_t n = w.candidates();
  const int64_t begin = chunk * layout.chunk;
  if (w.heavy_budget == 0 || begin >= n) return;
  const int64_t size = min(layout.chunk, n - begin);
  int32_t* out = p.indices + row * p.width;
  const int64_t first = w.sink_end + begin;
  const int64_t sink_count = w.sink_end - w.start;
  if (w.heavy_budget == n) {  // every candidate is kept: no scores needed
    for (int64_t i = threadIdx.x; i < size; i += kThreads) out[sink_count + begin + i] = static_cast<int32_t>(first + i);
    return;
  }
  const int32_t* info = ws.chunk_info + (row * layout.chunks + chunk) * 2;
  const int64_t offset = info[0], skip = info[1];
  const int32_t threshold = ws.row_info[row * 2 + 1];
  src.prepare(b, s, l, smem);
  ordered_compact<kItems>(
      size,
      [&](int64_t i) {
        const int32_t score = src.score(first + i);
        return score > threshold ? 2 : (score == threshold ? 1 : 0);
      },
      skip, out + offset, first, table);
}

// ---- generic path: one block per row, radix select ------------------------------------------
template <typename Source>
__global__ void __launch_bounds__(kThreads) radix_select_kernel(SelectionParams p, Source src) {
  using key_t = typename Source::key_t;
  extern __shared__ int32_t smem[];  // source scratch (query words)
  __shared__ int histogram[256];
  __shared__ int table[kItems * kWarps];
  __shared__ int chosen[2];
  const int64_t row = blockIdx.x;
  int64_t b, s, l;
  row_coordinates(p, row, b, s, l);
  const RowWindow w = p.window(b, l);
  write_fixed_part_of_row(p, row, w);
  const int64_t n = w.candidates(), m = w.heavy_budget;
  if (m == 0) return;
  int32_t* out = p.indices + row * p.width + (w.sink_end - w.start);
  if (m == n) {
    for (int64_t i = threadIdx.x; i < n; i += kThreads) out[i] = static_cast<int32_t>(w.sink_end + i);
    return;
  }
  src.prepare(b, s, l, smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  // Find the m-th best key V digit by digit: `remaining` is how many of the keys that match
  // the digits chosen so far are still needed.
  key_t prefix = 0, mask = 0;
  int64_t remaining = m, ties_at_threshold = 0;
  for (int shift = Source::kKeyBits - 8; shift >= 0; shift -= 8) {
    histogram[threadIdx.x] = 0;  // kThreads == 256 bins
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      const key_t k = src.key(w.sink_end + i);
      if ((k & mask) == prefix) atomicAdd(&histogram[(k >> shift) & 255], 1);
    }
    __syncthreads();
    if (warp == 0) {  // lane j owns digits [8j, 8j + 8); suffix sums from the top digit down
      int own = 0;
#pragma unroll
      for (int d = 0; d < 8; ++d) own += histogram[lane * 8 + d];
      int suffix = own;  // inclusive suffix over lanes >= lane
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const int other = __shfl_down_sync(0xffffffffu, suffix, offset);
        if (lane + offset < 32) suffix += other;
      }
      int above = suffix - own;  // keys in higher lanes' digits
      for (int d = 7; d >= 0; --d) {
        const int c = histogram[lane * 8 + d];
        if (above < remaining && above + c >= remaining) {
          chosen[0] = lane * 8 + d;
          chosen[1] = above;
        }
        above += c;
      }
    }
    __syncthreads();
    const int digit = chosen[0];
    remaining -= chosen[1];
    ties_at_threshold = histogram[digit];
    prefix |= static_cast<key_t>(digit) << shift;
    mask |= static_cast<key_t>(255) << shift;
    __syncthreads();  // everyone has read histogram/chosen before the next pass clears them
  }
  const key_t threshold = prefix;
  const int64_t skip = ties_at_threshold - remaining;
  ordered_compact<kItems>(
      n,
      [&](int64_t i) {
        const key_t k = src.key(w.sink_end + i);
        return k > threshold ? 2 : (k == threshold ? 1 : 0);
      },
      skip, out, w.sink_end, table);
}

SelectionParams make_params(const std::optional<at::Tensor>& lengths, const std::optional<at::Tensor>& starts,
                            const std::optional<at::Tensor>& budgets, const SelectionArgs& args, int64_t keys,
                            int64_t heads, int64_t rows, at::Tensor& indices, at::Tensor& counts) {
  SelectionParams p;
  p.lengths = SequenceVector(lengths);
  p.starts = SequenceVector(starts);
  p.budgets = SequenceVector(budgets);
  p.keys = keys;
  p.sink = args.sink;
  p.local = args.local;
  p.budget = args.budget;
  p.width = args.width();
  p.heads = heads;
  p.rows = rows;
  p.indices = indices.data_ptr<int32_t>();
  p.counts = counts.data_ptr<int32_t>();
  return p;
}

// Chunking from shapes only (never from lengths): about 4 blocks per multiprocessor in all.
ChunkLayout choose_layout(int64_t keys, int64_t row_count, int64_t bins) {
  const int64_t target_blocks = 4 * int64_t(multiprocessor_count());
  int64_t chunks = std::max<int64_t>(1, ceil_div(target_blocks, row_count));
  chunks = std::min(chunks, std::max<int64_t>(1, ceil_div(keys, kTile)));
  int64_t chunk = std::max<int64_t>(kTile, ceil_div(ceil_div(keys, chunks), kTile) * kTile);
  if (ceil_div(keys, chunk) > kMaxChunks) chunk = ceil_div(ceil_div(keys, kMaxChunks), kTile) * kTile;
  chunks = std::max<int64_t>(1, ceil_div(keys, chunk));
  return ChunkLayout{chunk, chunks, bins};
}

void launch_fast_path(const SelectionParams& p, const HammingSource& src, int64_t row_count,
                      const at::Tensor& like) {
  const ChunkLayout layout = choose_layout(p.keys, row_count, src.words * src.group * 32 + 1);
  const int64_t hist_ints = row_count * layout.chunks * layout.bins;
  const int64_t info_ints = row_count * layout.chunks * 2;
  at::Tensor workspace = at::empty({hist_ints + info_ints + row_count * 2}, like.options().dtype(at::kInt));
  FastWorkspace ws{workspace.data_ptr<int32_t>(), workspace.data_ptr<int32_t>() + hist_ints,
                   workspace.data_ptr<int32_t>() + hist_ints + info_ints};
  auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(row_count), static_cast<unsigned>(layout.chunks));
  const size_t q_bytes = sizeof(int32_t) * src.group * src.words;
  const size_t hist_smem = sizeof(int32_t) * layout.bins + q_bytes;
  const size_t threshold_smem = sizeof(int32_t) * (layout.bins + 2 * layout.chunks);
  TORCH_CHECK(hist_smem <= 48 * 1024 && threshold_smem <= 48 * 1024,
              "hamming_topk: internal shared-memory budget exceeded");
  hamming_histogram_kernel<<<grid, kThreads, hist_smem, stream>>>(p, src, layout, ws);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  hamming_threshold_kernel<<<static_cast<unsigned>(row_count), kThreads, threshold_smem, stream>>>(p, layout, ws);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  hamming_compact_kernel<<<grid, kThreads, q_bytes, stream>>>(p, src, layout, ws);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> hamming_topk_cuda(const at::Tensor& query_signatures,
                                                     const at::Tensor& key_signatures,
                                                     const std::optional<at::Tensor>& lengths,
                                                     const std::optional<at::Tensor>& start_positions,
                                                     const std::optional<at::Tensor>& budgets,
                                                     int64_t selection_heads, int64_t sink_tokens,
                                                     int64_t local_tokens, int64_t budget_tokens) {
  const HammingDims dims = check_hamming_args(query_signatures, key_signatures, selection_heads);
  const SelectionArgs args = check_selection_args(lengths, start_positions, budgets, dims.batch, query_signatures,
                                                  "query_signatures", sink_tokens, local_tokens, budget_tokens);
  const c10::cuda::CUDAGuard guard(query_signatures.device());
  auto int_options = query_signatures.options().dtype(at::kInt);
  at::Tensor indices = new_output({dims.batch, dims.selection_heads, dims.rows, args.width()}, int_options);
  at::Tensor counts = new_output({dims.batch, dims.selection_heads, dims.rows}, int_options);
  const int64_t row_count = counts.numel();
  if (row_count == 0) return {indices, counts};

  const SelectionParams p = make_params(lengths, start_positions, budgets, args, dims.keys, dims.selection_heads,
                                        dims.rows, indices, counts);
  const auto& q = query_signatures;
  const auto& k = key_signatures;
  HammingSource src{};
  src.q = q.data_ptr<int32_t>();
  src.qs0 = q.stride(0);
  src.qs1 = q.stride(1);
  src.qs2 = q.stride(2);
  src.k = k.data_ptr<int32_t>();
  src.ks0 = k.stride(0);
  src.ks1 = k.stride(1);
  src.ks2 = k.stride(2);
  src.words = static_cast<int>(dims.words);
  src.group = static_cast<int>(dims.heads_per_selection());
  src.per_key = static_cast<int>(dims.query_heads_per_key_head());
  // All query heads of a group read one key head when the group lies inside one key head's span.
  src.shared_key_head = (src.per_key % src.group == 0) ? 1 : 0;

  if (dims.max_score() + 1 <= kFastBins) {
    launch_fast_path(p, src, row_count, query_signatures);
  } else {
    const size_t q_bytes = sizeof(int32_t) * src.group * src.words;
    TORCH_CHECK(q_bytes <= 48 * 1024, "hamming_topk: query signatures of a group exceed shared memory");
    radix_select_kernel<HammingSource>
        <<<static_cast<unsigned>(row_count), kThreads, q_bytes, at::cuda::getCurrentCUDAStream()>>>(p, src);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {indices, counts};
}

std::tuple<at::Tensor, at::Tensor> topk_from_scores_cuda(const at::Tensor& scores,
                                                         const std::optional<at::Tensor>& lengths,
                                                         const std::optional<at::Tensor>& start_positions,
                                                         const std::optional<at::Tensor>& budgets,
                                                         int64_t sink_tokens, int64_t local_tokens,
                                                         int64_t budget_tokens) {
  const ScoreSelectionDims dims = check_score_selection_args(scores, lengths, start_positions, budgets, sink_tokens,
                                                             local_tokens, budget_tokens);
  const auto dtype = scores.scalar_type();
  const int64_t batch = dims.batch, heads = dims.heads, rows = dims.rows, keys = dims.keys;
  const SelectionArgs args = dims.selection;
  const c10::cuda::CUDAGuard guard(scores.device());
  auto int_options = scores.options().dtype(at::kInt);
  at::Tensor indices = new_output({batch, heads, rows, args.width()}, int_options);
  at::Tensor counts = new_output({batch, heads, rows}, int_options);
  const int64_t row_count = counts.numel();
  if (row_count == 0) return {indices, counts};
  const SelectionParams p = make_params(lengths, start_positions, budgets, args, keys, heads, rows, indices, counts);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "topk_from_scores_cuda", [&] {
    TensorSource<scalar_t> src{};
    src.data = scores.data_ptr<scalar_t>();
    src.s0 = scores.stride(0);
    src.s1 = scores.stride(1);
    src.s2 = scores.stride(2);
    src.s3 = scores.stride(3);
    radix_select_kernel<TensorSource<scalar_t>><<<static_cast<unsigned>(row_count), kThreads, 0, stream>>>(p, src);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {indices, counts};
}

}  // namespace cuda

TORCH_LIBRARY_IMPL(hashattention, CUDA, m) {
  m.impl("hamming_topk", &cuda::hamming_topk_cuda);
  m.impl("topk_from_scores", &cuda::topk_from_scores_cuda);
}

}  // namespace hashattention
