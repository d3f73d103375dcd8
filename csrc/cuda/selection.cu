// CUDA kernels of `hamming_topk` and `topk_from_scores`: exact top-k selection with the
// sink/local budget contract of selection_window.h, identical to the CPU kernels (same set,
// same order, ties to the later position, -1 padding, counts).
//
// Fast path of hamming_topk (a row's scores take only max_score + 1 <= kFastBins values):
// each row is split into chunks of absolute positions so that even batch 1 fills the GPU,
// and two kernels run over the (row, chunk) grid:
//   1. histogram: each block scores its chunk's candidates and writes the chunk's histogram;
//   2. compaction: each block sums the row's chunk histograms, finds the threshold score T
//      (the largest with count(score >= T) >= m) and how many of the ties at T to skip (the
//      earliest ones), derives its chunk's output offset, scores its chunk again (the
//      signatures are L2-hot) and writes its selected positions in order; the chunk-0 block
//      also writes the sink and local windows, the padding and the count.
// No score tensor is written and nothing is sorted. Every other case (larger score ranges,
// and topk_from_scores for any dtype) runs one block per row: an exact radix select over
// order-preserving keys, 8 bits per pass, then an ordered compaction.
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

constexpr int kItems = 4;  // elements per thread per tile of the radix-select path
// Fast path: chunks are whole multiples of one block-wide step of 4-position groups, and start
// at multiples of it in absolute positions, so 16-byte signature loads stay aligned.
constexpr int64_t kChunkQuantum = int64_t(4) * kThreads;
constexpr int64_t kFastBins = 2049;       // score ranges the histogram path handles
constexpr int kHistogramInts = 4096;      // chunks x bins of one row, read by every compaction block
constexpr int kPerThreadMaxBins = 33;     // per-thread counters: bins * kThreads ints of shared memory
constexpr int kPerWarpMaxBins = 1024;     // per-warp histograms: bins * kWarps ints

struct ChunkLayout {
  int64_t chunk;   // positions per chunk (multiple of kChunkQuantum)
  int64_t chunks;  // chunks per row (grid dimension): ceil(N / chunk)
  int bins;        // possible scores: 32 * W * group + 1
};

// Workspace of the fast path: per row, chunks x bins histograms (int32).
struct FastWorkspace {
  int32_t* histograms;
};

__device__ __forceinline__ void row_coordinates(const SelectionParams& p, int64_t row, int64_t& b, int64_t& s,
                                                int64_t& l) {
  l = row % p.rows;
  s = (row / p.rows) % p.heads;
  b = row / (p.rows * p.heads);
}

// ---- fast path, kernel 1: chunk histograms --------------------------------------------------
// Block (row, chunk) counts the scores of the row's candidates inside the chunk. Threads take
// aligned groups of four positions (one 16-byte load of W = 1 signatures). Scores cluster on a
// few values, so the counters are privatised to avoid same-address conflicts:
//   kPerThread: one counter per (bin, thread) -- plain increments, conflict-free (bins <= 33);
//   kPerWarp:   one histogram per warp, shared-memory atomics (bins <= kPerWarpMaxBins);
//   kPerBlock:  one histogram per block, shared-memory atomics.
enum HistogramMode : int { kPerThread = 0, kPerWarp = 1, kPerBlock = 2 };

template <int kMode>
__global__ void __launch_bounds__(kThreads)
    hamming_histogram_kernel(SelectionParams p, HammingSource src, ChunkLayout layout, FastWorkspace ws) {
  extern __shared__ int32_t smem[];
  const int64_t row = blockIdx.x, chunk = blockIdx.y;
  int64_t b, s, l;
  row_coordinates(p, row, b, s, l);
  const RowWindow w = p.window(b, l);
  const int64_t n = w.candidates();
  if (w.heavy_budget == 0 || w.heavy_budget == n) return;  // the compaction needs no scores
  const int64_t base = chunk * layout.chunk;
  const int64_t lo = max64(w.sink_end, base), hi = min64(w.local_begin, base + layout.chunk);
  if (lo >= hi) return;  // the compaction never reads this chunk's histogram

  const int bins = layout.bins;
  const int counters = kMode == kPerThread ? bins * kThreads : (kMode == kPerWarp ? bins * kWarps : bins);
  int32_t* histogram = smem;
  for (int v = threadIdx.x; v < counters; v += kThreads) histogram[v] = 0;
  src.prepare(b, s, l, smem + counters);  // ends with a barrier
  const int warp = threadIdx.x >> 5;
  const int64_t first_group = (lo - base) >> 2, end_group = ((hi - 1 - base) >> 2) + 1;
#pragma unroll 2
  for (int64_t g = first_group + threadIdx.x; g < end_group; g += kThreads) {
    int32_t score[4];
    src.score4(base + 4 * g, lo, hi, score);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (score[j] < 0) continue;
      if (kMode == kPerThread) {
        histogram[score[j] * kThreads + threadIdx.x] += 1;  // bank = thread % 32: no conflicts
      } else if (kMode == kPerWarp) {
        atomicAdd(&histogram[warp * bins + score[j]], 1);
      } else {
        atomicAdd(&histogram[score[j]], 1);
      }
    }
  }
  __syncthreads();
  int32_t* out = ws.histograms + (row * layout.chunks + chunk) * bins;
  if (kMode == kPerThread) {  // warp per bin: sum its kThreads counters
    const int lane = threadIdx.x & 31;
    for (int v = warp; v < bins; v += kWarps) {
      int32_t total = 0;
#pragma unroll
      for (int t = lane; t < kThreads; t += 32) total += histogram[v * kThreads + t];
      total = static_cast<int32_t>(__reduce_add_sync(0xffffffffu, static_cast<unsigned>(total)));
      if (lane == 0) out[v] = total;
    }
  } else {
    for (int v = threadIdx.x; v < bins; v += kThreads) {
      int32_t total = 0;
      if (kMode == kPerWarp) {
#pragma unroll
        for (int k = 0; k < kWarps; ++k) total += histogram[k * bins + v];
      } else {
        total = histogram[v];
      }
      out[v] = total;
    }
  }
}

// ---- fast path, kernel 2: threshold, chunk offset and ordered compaction --------------------
// Block (row, chunk) reads the histograms of all the row's chunks (at most kHistogramInts
// counters, from L2), finds the threshold score T (the largest with count(score >= T) >= m)
// and how many of the ties at T to drop (the earliest ones), derives where its chunk's
// selected entries start and how many of its own ties to drop, then writes its selected
// positions in order. Every block of a row repeats the threshold search: that costs a few
// hundred shared-memory reads and saves a kernel launch between the two phases.
// The chunk is split into one contiguous segment per warp: a first pass counts each
// segment's entries, a second pass writes them (a warp scan orders the entries of 128
// consecutive positions), so no block barrier runs per tile.
__global__ void __launch_bounds__(kThreads)
    hamming_compact_kernel(SelectionParams p, HammingSource src, ChunkLayout layout, FastWorkspace ws) {
  extern __shared__ int32_t smem[];  // query words, then the row's chunk histograms, then the total
  __shared__ int64_t scan_scratch[kWarps];
  __shared__ int64_t found[2];
  __shared__ int32_t segment_counts[kWarps][2];
  const int64_t row = blockIdx.x, chunk = blockIdx.y;
  int64_t b, s, l;
  row_coordinates(p, row, b, s, l);
  const RowWindow w = p.window(b, l);
  if (chunk == 0) write_fixed_part_of_row(p, row, w);
  const int64_t n = w.candidates(), m = w.heavy_budget;
  if (m == 0) return;
  const int64_t base = chunk * layout.chunk;
  const int64_t lo = max64(w.sink_end, base), hi = min64(w.local_begin, base + layout.chunk);
  if (lo >= hi) return;
  // Heavy slot j of the row holds its j-th selected candidate.
  int32_t* out = p.indices + row * p.width + (w.sink_end - w.start);
  if (m == n) {  // every candidate is kept: no scores needed
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) out[i - w.sink_end] = static_cast<int32_t>(i);
    return;
  }

  // 1. The row's histogram (sum over its chunks that hold candidates).
  const int bins = layout.bins;
  const int64_t c_first = w.sink_end / layout.chunk, c_last = (w.local_begin - 1) / layout.chunk;
  const int chunk_count = static_cast<int>(c_last - c_first + 1), own = static_cast<int>(chunk - c_first);
  int32_t* q_words = smem;
  int32_t* chunk_hist = smem + src.group * src.words;
  int32_t* histogram = chunk_hist + chunk_count * bins;
  const int32_t* hist_src = ws.histograms + (row * layout.chunks + c_first) * bins;
  for (int i = threadIdx.x; i < chunk_count * bins; i += kThreads) chunk_hist[i] = __ldcg(hist_src + i);
  __syncthreads();
  for (int v = threadIdx.x; v < bins; v += kThreads) {
    int32_t total = 0;
    for (int c = 0; c < chunk_count; ++c) total += chunk_hist[c * bins + v];
    histogram[v] = total;
  }
  __syncthreads();

  // 2. Threshold: thread t owns the t-th segment of bins counted from the top, so an exclusive
  // scan over threads gives the number of candidates scoring above its segment.
  {
    const int per_thread = (bins + kThreads - 1) / kThreads;
    const int seg_hi = bins - static_cast<int>(threadIdx.x) * per_thread;  // segment is [seg_lo, seg_hi)
    const int seg_lo = max(seg_hi - per_thread, 0);
    int64_t segment = 0;
    for (int v = seg_lo; v < seg_hi; ++v) segment += histogram[v];
    int64_t total;
    int64_t above = block_exclusive_scan(seg_hi > 0 ? segment : 0, scan_scratch, total);
    for (int v = seg_hi - 1; v >= seg_lo; --v) {
      if (above < m && above + histogram[v] >= m) {
        found[0] = v;
        found[1] = above;
      }
      above += histogram[v];
    }
  }
  __syncthreads();
  const int threshold = static_cast<int>(found[0]);
  const int64_t skip = histogram[threshold] - (m - found[1]);  // earliest ties at T are dropped

  // 3. Entries better than T and ties at T in the chunks before this one.
  int64_t packed = 0;  // better << 32 | ties, summed over this thread's counters
  for (int i = threadIdx.x; i < own * bins; i += kThreads) {
    const int v = i % bins;
    if (v > threshold) packed += int64_t(chunk_hist[i]) << 32;
    if (v == threshold) packed += chunk_hist[i];
  }
  int64_t before_total;
  block_exclusive_scan(packed, scan_scratch, before_total);
  const int64_t better_before = before_total >> 32, ties_before = before_total & 0xffffffffll;
  const int64_t own_ties = chunk_hist[own * bins + threshold];
  const int64_t chunk_skip = min64(max64(skip - ties_before, 0), own_ties);
  out += better_before + max64(ties_before - skip, 0);

  // 4. Ordered compaction of the chunk, one contiguous run of 4-position groups per warp.
  src.prepare(b, s, l, q_words);  // ends with a barrier
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t first_group = (lo - base) >> 2, end_group = ((hi - 1 - base) >> 2) + 1;
  const int64_t per_warp = ceil_div(ceil_div(end_group - first_group, int64_t(kWarps)), int64_t(32)) * 32;
  const int64_t seg_begin = min64(first_group + warp * per_warp, end_group);
  const int64_t seg_end = min64(seg_begin + per_warp, end_group);
  const auto flags_of = [&](int64_t g, int (&f)[4]) {
    int32_t score[4];
    if (g < seg_end) {
      src.score4(base + 4 * g, lo, hi, score);
    } else {
      score[0] = score[1] = score[2] = score[3] = -1;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) f[j] = score[j] > threshold ? 2 : (score[j] == threshold ? 1 : 0);
  };
  unsigned better = 0, ties = 0;
  for (int64_t g = seg_begin + lane; g < seg_end; g += 32) {
    int f[4];
    flags_of(g, f);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      better += f[j] == 2;
      ties += f[j] == 1;
    }
  }
  better = __reduce_add_sync(0xffffffffu, better);
  ties = __reduce_add_sync(0xffffffffu, ties);
  if (lane == 0) {
    segment_counts[warp][0] = static_cast<int32_t>(better);
    segment_counts[warp][1] = static_cast<int32_t>(ties);
  }
  __syncthreads();
  int64_t better_run = 0, ties_run = 0;  // entries of this chunk before the current warp tile
  for (int k = 0; k < warp; ++k) {
    better_run += segment_counts[k][0];
    ties_run += segment_counts[k][1];
  }
  for (int64_t tile = seg_begin; tile < seg_end; tile += 32) {  // uniform trip count in the warp
    int f[4];
    flags_of(tile + lane, f);
    int own_better = 0, own_ties_count = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      own_better += f[j] == 2;
      own_ties_count += f[j] == 1;
    }
    // Lanes hold consecutive groups, so position order is (lane, j): an exclusive scan over
    // lanes of (better | ties << 16) orders the entries of the tile.
    const int mine = own_better | (own_ties_count << 16);
    int inclusive = mine;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += other;
    }
    const int tile_total = __shfl_sync(0xffffffffu, inclusive, 31);
    if (mine != 0) {
      const int exclusive = inclusive - mine;
      int64_t better_before_entry = better_run + (exclusive & 0xffff);
      int64_t ties_before_entry = ties_run + (exclusive >> 16);
      const int64_t position = base + 4 * (tile + lane);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (f[j] == 2) {
          out[better_before_entry + max64(ties_before_entry - chunk_skip, 0)] = static_cast<int32_t>(position + j);
          ++better_before_entry;
        } else if (f[j] == 1) {
          if (ties_before_entry >= chunk_skip) {
            out[better_before_entry + ties_before_entry - chunk_skip] = static_cast<int32_t>(position + j);
          }
          ++ties_before_entry;
        }
      }
    }
    better_run += tile_total & 0xffff;
    ties_run += tile_total >> 16;
  }
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

// Chunking from shapes only (never from lengths): about 4 blocks per multiprocessor in all, and
// at most kHistogramInts counters per row so that every compaction block can read them all.
ChunkLayout choose_layout(int64_t keys, int64_t row_count, int bins) {
  const int64_t target_blocks = 4 * int64_t(multiprocessor_count());
  int64_t chunks = std::max<int64_t>(1, ceil_div(target_blocks, row_count));
  chunks = std::min(chunks, std::max<int64_t>(1, kHistogramInts / bins));
  chunks = std::min(chunks, std::max<int64_t>(1, ceil_div(keys, kChunkQuantum)));
  const int64_t chunk = ceil_div(ceil_div(keys, chunks), kChunkQuantum) * kChunkQuantum;
  return ChunkLayout{chunk, ceil_div(keys, chunk), bins};
}

template <int kMode>
void launch_histogram(const dim3& grid, size_t smem, cudaStream_t stream, const SelectionParams& p,
                      const HammingSource& src, const ChunkLayout& layout, const FastWorkspace& ws) {
  hamming_histogram_kernel<kMode><<<grid, kThreads, smem, stream>>>(p, src, layout, ws);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_fast_path(const SelectionParams& p, const HammingSource& src, int64_t row_count,
                      const at::Tensor& like) {
  const ChunkLayout layout = choose_layout(p.keys, row_count, src.words * src.group * 32 + 1);
  at::Tensor workspace = at::empty({row_count * layout.chunks * layout.bins}, like.options().dtype(at::kInt));
  const FastWorkspace ws{workspace.data_ptr<int32_t>()};
  auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(row_count), static_cast<unsigned>(layout.chunks));
  const size_t q_bytes = sizeof(int32_t) * src.group * src.words;
  const int bins = layout.bins;
  const int mode = bins <= kPerThreadMaxBins ? kPerThread : (bins <= kPerWarpMaxBins ? kPerWarp : kPerBlock);
  const int counters = mode == kPerThread ? bins * kThreads : (mode == kPerWarp ? bins * kWarps : bins);
  const size_t hist_smem = sizeof(int32_t) * counters + q_bytes;
  const int64_t row_hist_ints = layout.chunks * bins + bins;  // the row's chunk histograms and their sum
  const size_t compact_smem = q_bytes + sizeof(int32_t) * row_hist_ints;
  TORCH_CHECK(hist_smem <= 48 * 1024 && compact_smem <= 48 * 1024,
              "hamming_topk: internal shared-memory budget exceeded");
  if (mode == kPerThread) {
    launch_histogram<kPerThread>(grid, hist_smem, stream, p, src, layout, ws);
  } else if (mode == kPerWarp) {
    launch_histogram<kPerWarp>(grid, hist_smem, stream, p, src, layout, ws);
  } else {
    launch_histogram<kPerBlock>(grid, hist_smem, stream, p, src, layout, ws);
  }
  hamming_compact_kernel<<<grid, kThreads, compact_smem, stream>>>(p, src, layout, ws);
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
  src.vector_keys = (src.words == 1 && src.shared_key_head && k.stride(2) == 1 && k.stride(1) % 4 == 0 &&
                     k.stride(0) % 4 == 0 && reinterpret_cast<uintptr_t>(k.data_ptr()) % 16 == 0)
                        ? 1
                        : 0;

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
