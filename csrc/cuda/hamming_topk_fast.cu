// Fast path of the CUDA hamming_topk: exact top-k by counting, when a row's scores take at most
// kFastBins values (32 * W * group + 1). Same contract and output as the CPU kernel.
//
// Work decomposition. Rows that read the same key head and window -- the selection heads of one
// KV head in per-query-head mode, for the same sequence and query row -- form a "row set" of
// kRows rows, so each key signature is loaded once (16-byte loads of four positions) and scored
// for all of them. Positions [0, N) are cut into chunks of `chunk` absolute positions (a
// multiple of 1024, so loads stay aligned); the grid is (row set, chunk). Two kernels:
//   1. histogram: each block counts its chunk's candidate scores per row and writes the
//      histograms (no score tensor is written);
//   2. compaction: each block sums the row set's chunk histograms (from L2), finds each row's
//      threshold score T (the largest with count(score >= T) >= m) and how many of the ties at
//      T to drop (the earliest ones), derives where its chunk's entries go, then scores its
//      chunk once more, keeping 2-bit flags (better / tie) in shared memory, and writes the
//      selected positions in order: a first pass counts each warp segment's entries, a second
//      orders a tile's entries with one warp scan. The chunk-0 block also writes the windows,
//      the padding and the counts.
// Every block of a row set repeats the threshold search (a few hundred shared-memory reads):
// cheaper than a third kernel launch between the phases. Nothing depends on device data on the
// host, so the launches are CUDA-graph safe.
#include "hamming_topk_fast.h"

#include <algorithm>

namespace hashattention {
namespace cuda {
namespace {

constexpr int kMaxChunkPositions = 64512;  // 8-bit per-thread counters: <= 255 positions per thread
constexpr int kChunkQuantum = 1024;        // chunk sizes and starts: multiples of 1024 positions
// Preferred smallest chunk: below it each compaction block's fixed work (summing the chunk
// histograms, the threshold search) outweighs its share of the scan (H200, group-shared
// selection at 128K: 11.7 -> 16.3 us when 2048-position chunks replaced 4096-position ones).
// Smaller chunks (down to kChunkQuantum) are used only when 4096-position chunks would leave
// multiprocessors idle (group-shared at 32K: 8 rows x 8 chunks = 64 blocks ran 10.3 us, 256
// blocks of 1024 positions 7.7 us).
constexpr int kMinChunkPositions = 4096;
constexpr int kLoadBatch = 4;              // 16-byte loads in flight per thread
constexpr int kPackedMaxBins = 64;         // per-thread 8-bit counters, 4 per word, up to this many bins
constexpr int kBlocksPerSm = 4;            // grid size target: the compaction's register limit

enum HistogramMode : int { kPacked = 0, kPerWarp = 1, kPerBlock = 2 };

struct FastLayout {
  int64_t chunk;   // positions per chunk
  int64_t chunks;  // chunks per row set: ceil(N / chunk)
  int bins;        // possible scores of a row
  int sets_per_sequence_row;  // selection heads / kRows
};

__device__ __forceinline__ void set_coordinates(const SelectionParams& p, const FastLayout& layout, int64_t set,
                                                int64_t& b, int64_t& s_set, int64_t& l) {
  l = set % p.rows;
  s_set = (set / p.rows) % layout.sets_per_sequence_row;
  b = set / (p.rows * layout.sets_per_sequence_row);
}

// Row set state: query words of its rows in shared memory, and how to score four positions.
// kSingleWord (W == 1 and one key head per group): a score is a few popcounts of the loaded key
// word. Otherwise (kRows == 1) the general HammingSource::score runs per position. The two are
// separate instantiations so that the unrolled hot loops stay small: inlining the general score
// into them made kernels of ~100K instructions that thrashed the instruction cache.
template <int kRows, bool kSingleWord>
struct RowSetScorer {
  static_assert(kSingleWord || kRows == 1, "row sets of several rows need single-word signatures");
  HammingSource src;
  const int32_t* q;  // shared memory: kRows * group * words
  int group;

  // Copies the query words of rows s_first .. s_first + kRows - 1 to shared memory (barrier).
  __device__ __forceinline__ void prepare(int64_t b, int64_t s_first, int64_t l, int32_t* smem) {
    src.prepare(b, s_first, l, smem, kRows);
    q = smem;
    group = src.group;
  }

  // Loads what scoring positions p .. p + 3 needs (p a multiple of 4): the four key words when
  // kSingleWord (one 16-byte load when all four lie in [lo, hi)). Returns the mask of positions
  // inside [lo, hi), the only ones scored.
  __device__ __forceinline__ unsigned load(int64_t p, int64_t lo, int64_t hi, int32_t (&kw)[4]) const {
    if (p >= lo && p + 4 <= hi) {
      if constexpr (kSingleWord) {
        if (src.vector_keys) {
          const int4 v = __ldg(reinterpret_cast<const int4*>(src.key_row + p));
          kw[0] = v.x, kw[1] = v.y, kw[2] = v.z, kw[3] = v.w;
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) kw[j] = __ldg(src.key_row + (p + j) * src.ks2);
        }
      }
      return 0xfu;
    }
    unsigned valid = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool inside = p + j >= lo && p + j < hi;
      kw[j] = (kSingleWord && inside) ? __ldg(src.key_row + (p + j) * src.ks2) : 0;
      valid |= unsigned(inside) << j;
    }
    return valid;
  }

  // Score of row r at position p + j, given load()'s words.
  __device__ __forceinline__ int32_t score(int r, int64_t p, int j, const int32_t (&kw)[4]) const {
    if constexpr (kSingleWord) {
      if (group == 1) return 32 - __popc(static_cast<unsigned>(q[r] ^ kw[j]));  // per-query-head selection
      int32_t distance = 0;
#pragma unroll 1
      for (int g = 0; g < group; ++g) distance += __popc(static_cast<unsigned>(q[r * group + g] ^ kw[j]));
      return 32 * group - distance;
    } else {
      return src.score(p + j);
    }
  }
};

// ---- kernel 1: chunk histograms ------------------------------------------------------------
// Counters are privatised because scores cluster on a few values (same-address conflicts):
//   kPacked:   per thread, four 8-bit counters per word, [row][word][thread] (conflict-free);
//   kPerWarp:  one histogram per (row, warp), shared-memory atomics;
//   kPerBlock: one histogram per row, shared-memory atomics.
template <int kRows, int kMode, bool kSingleWord>
__global__ void __launch_bounds__(kThreads)
    fast_histogram_kernel(SelectionParams p, HammingSource src, FastLayout layout, int32_t* histograms) {
  extern __shared__ int32_t smem[];
  const int64_t set = blockIdx.x, chunk = blockIdx.y;
  int64_t b, s_set, l;
  set_coordinates(p, layout, set, b, s_set, l);
  const RowWindow w = p.window(b, l);
  const int64_t n = w.candidates();
  if (w.heavy_budget == 0 || w.heavy_budget == n) return;  // the compaction needs no scores
  const int64_t base = chunk * layout.chunk;
  const int64_t lo = max64(w.sink_end, base), hi = min64(w.local_begin, base + layout.chunk);
  if (lo >= hi) return;  // the compaction never reads this chunk's histogram

  const int bins = layout.bins, words = (bins + 3) / 4;
  const int counters = kMode == kPacked ? kRows * words * kThreads : (kMode == kPerWarp ? kRows * bins * kWarps
                                                                                         : kRows * bins);
  for (int i = threadIdx.x; i < counters; i += kThreads) smem[i] = 0;
  RowSetScorer<kRows, kSingleWord> scorer{src};
  scorer.prepare(b, s_set * kRows, l, smem + counters);  // ends with a barrier
  uint32_t* packed = reinterpret_cast<uint32_t*>(smem);
  constexpr int kBatch = kSingleWord ? kLoadBatch : 1;  // general scores are long: no unrolled copies
  const int warp = threadIdx.x >> 5;
  const int64_t first_group = (lo - base) >> 2, end_group = ((hi - 1 - base) >> 2) + 1;
  for (int64_t g0 = first_group + threadIdx.x; g0 < end_group; g0 += int64_t(kBatch) * kThreads) {
    int32_t kw[kBatch][4];
    unsigned valid[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {  // all loads first: several in flight per thread
      const int64_t g = g0 + int64_t(i) * kThreads;
      valid[i] = g < end_group ? scorer.load(base + 4 * g, lo, hi, kw[i]) : 0u;
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int64_t position = base + 4 * (g0 + int64_t(i) * kThreads);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (!((valid[i] >> j) & 1u)) continue;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int v = scorer.score(r, position, j, kw[i]);
          if constexpr (kMode == kPacked) {
            packed[(r * words + (v >> 2)) * kThreads + threadIdx.x] += 1u << ((v & 3) * 8);
          } else if constexpr (kMode == kPerWarp) {
            atomicAdd(&smem[(r * kWarps + warp) * bins + v], 1);
          } else {
            atomicAdd(&smem[r * bins + v], 1);
          }
        }
      }
    }
  }
  __syncthreads();
  int32_t* out = histograms + (set * layout.chunks + chunk) * kRows * bins;
  if (kMode == kPacked) {  // a warp per (row, word): sum the four byte counters over the threads
    const int lane = threadIdx.x & 31;
    for (int rw = warp; rw < kRows * words; rw += kWarps) {
      unsigned sums[4] = {0, 0, 0, 0};
#pragma unroll
      for (int t = lane; t < kThreads; t += 32) {
        const uint32_t c = packed[rw * kThreads + t];
#pragma unroll
        for (int k = 0; k < 4; ++k) sums[k] += (c >> (8 * k)) & 0xffu;
      }
      const int r = rw / words, v0 = (rw % words) * 4;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const unsigned total = __reduce_add_sync(0xffffffffu, sums[k]);
        if (lane == 0 && v0 + k < bins) out[r * bins + v0 + k] = static_cast<int32_t>(total);
      }
    }
  } else {
    for (int i = threadIdx.x; i < kRows * bins; i += kThreads) {
      int32_t total = 0;
      if (kMode == kPerWarp) {
        const int r = i / bins, v = i % bins;
#pragma unroll
        for (int k = 0; k < kWarps; ++k) total += smem[(r * kWarps + k) * bins + v];
      } else {
        total = smem[i];
      }
      out[i] = total;
    }
  }
}

// ---- kernel 2: thresholds, offsets and ordered compaction ----------------------------------
template <int kRows, bool kSingleWord>
__global__ void __launch_bounds__(kThreads)
    fast_compact_kernel(SelectionParams p, HammingSource src, FastLayout layout, const int32_t* histograms) {
  extern __shared__ int32_t smem[];
  __shared__ int32_t row_threshold[kRows];
  __shared__ int64_t row_skip[kRows], row_offset[kRows];
  __shared__ int32_t segment_counts[kWarps][kRows][2];
  const int64_t set = blockIdx.x, chunk = blockIdx.y;
  int64_t b, s_set, l;
  set_coordinates(p, layout, set, b, s_set, l);
  const RowWindow w = p.window(b, l);
  const int64_t first_row = (b * p.heads + s_set * kRows) * p.rows + l;  // row r: first_row + r * p.rows
  if (chunk == 0) {
#pragma unroll 1
    for (int r = 0; r < kRows; ++r) write_fixed_part_of_row(p, first_row + r * p.rows, w);
  }
  const int64_t n = w.candidates(), m = w.heavy_budget;
  if (m == 0) return;
  const int64_t base = chunk * layout.chunk;
  const int64_t lo = max64(w.sink_end, base), hi = min64(w.local_begin, base + layout.chunk);
  if (lo >= hi) return;
  const int64_t heavy_offset = w.sink_end - w.start;  // heavy slot j of a row holds its j-th pick
  if (m == n) {  // every candidate is kept: no scores needed
#pragma unroll 1
    for (int r = 0; r < kRows; ++r) {
      int32_t* out = p.indices + (first_row + r * p.rows) * p.width + heavy_offset;
      for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) out[i - w.sink_end] = static_cast<int32_t>(i);
    }
    return;
  }

  // 1. Per row: the histogram of all its candidates, and of those in the chunks before this one.
  const int bins = layout.bins, pairs = kRows * bins;
  const int64_t c_first = w.sink_end / layout.chunk, c_last = (w.local_begin - 1) / layout.chunk;
  const int chunk_count = static_cast<int>(c_last - c_first + 1), own = static_cast<int>(chunk - c_first);
  const int64_t groups = layout.chunk / 4;
  int32_t* totals = smem;                // pairs
  int32_t* before = smem + pairs;        // pairs
  int32_t* q_words = smem + 2 * pairs;   // kRows * group * words
  uint8_t* flags = reinterpret_cast<uint8_t*>(q_words + kRows * src.group * src.words);  // kRows * groups
  const int32_t* set_hist = histograms + (set * layout.chunks + c_first) * pairs;
  for (int i = threadIdx.x; i < 2 * pairs; i += kThreads) smem[i] = 0;
  __syncthreads();
  // Every thread sums a few (chunk, bin) entries: all loads issued before the shared atomics, so
  // the whole table arrives in about one L2 round trip.
  constexpr int kSumBatch = 4;
  const int entries = pairs * chunk_count;
  for (int i0 = threadIdx.x; i0 < entries; i0 += kSumBatch * kThreads) {
    int32_t h[kSumBatch];
#pragma unroll
    for (int k = 0; k < kSumBatch; ++k) {
      const int i = i0 + k * kThreads;
      h[k] = i < entries ? __ldcg(set_hist + i) : 0;
    }
#pragma unroll
    for (int k = 0; k < kSumBatch; ++k) {
      if (h[k] == 0) continue;
      const int i = i0 + k * kThreads, c = i / pairs, pair = i - c * pairs;
      atomicAdd(&totals[pair], h[k]);
      if (c < own) atomicAdd(&before[pair], h[k]);
    }
  }
  RowSetScorer<kRows, kSingleWord> scorer{src};
  scorer.prepare(b, s_set * kRows, l, q_words);  // ends with a barrier

  // 2. Per row (one warp each): threshold T, ties to drop, this chunk's output offset and skip.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp < kRows) {
    const int r = warp;
    const int32_t* hist = totals + r * bins;
    const int per_lane = (bins + 31) / 32;  // lane t owns the t-th run of bins counted from the top
    const int seg_hi = max(bins - lane * per_lane, 0), seg_lo = max(seg_hi - per_lane, 0);
    int64_t segment = 0;
    for (int v = seg_lo; v < seg_hi; ++v) segment += hist[v];
    int64_t inclusive = segment;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int64_t other = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += other;
    }
    int64_t above = inclusive - segment;  // candidates in higher lanes' (higher) bins
    int threshold = -1;
    int64_t above_threshold = 0;
    for (int v = seg_hi - 1; v >= seg_lo; --v) {
      if (above < m && above + hist[v] >= m) {
        threshold = v;
        above_threshold = above;
      }
      above += hist[v];
    }
    const int owner = __ffs(__ballot_sync(0xffffffffu, threshold >= 0)) - 1;  // exactly one lane: 0 < m < n
    threshold = __shfl_sync(0xffffffffu, threshold, owner);
    above_threshold = __shfl_sync(0xffffffffu, above_threshold, owner);
    const int64_t skip = hist[threshold] - (m - above_threshold);  // earliest ties at T are dropped
    unsigned better_before = 0;
    for (int v = threshold + 1 + lane; v < bins; v += 32) better_before += before[r * bins + v];
    better_before = __reduce_add_sync(0xffffffffu, better_before);
    const int64_t ties_before = before[r * bins + threshold];
    const int64_t own_ties = __ldcg(set_hist + own * pairs + r * bins + threshold);
    if (lane == 0) {
      row_threshold[r] = threshold;
      row_skip[r] = min64(max64(skip - ties_before, 0), own_ties);
      row_offset[r] = heavy_offset + int64_t(better_before) + max64(ties_before - skip, 0);
    }
  }
  __syncthreads();

  // 3. Pass a: flags of the chunk (bit 2j + 1: better than T, bit 2j: tie at T, for position
  // 4g + j) and each warp segment's counts. Segments are whole 32-group tiles.
  int threshold[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) threshold[r] = row_threshold[r];
  const int64_t first_group = (lo - base) >> 2, end_group = ((hi - 1 - base) >> 2) + 1;
  const int64_t per_warp = ceil_div(ceil_div(end_group - first_group, int64_t(kWarps)), int64_t(32)) * 32;
  const int64_t seg_begin = min64(first_group + warp * per_warp, end_group);
  const int64_t seg_end = min64(seg_begin + per_warp, end_group);
  constexpr int kBatch = kSingleWord ? kLoadBatch : 1;
  unsigned better[kRows], ties[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) better[r] = ties[r] = 0;
  for (int64_t g0 = seg_begin + lane; g0 < seg_end; g0 += 32 * kBatch) {
    int32_t kw[kBatch][4];
    unsigned valid[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int64_t g = g0 + 32 * i;
      valid[i] = g < seg_end ? scorer.load(base + 4 * g, lo, hi, kw[i]) : 0u;
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int64_t g = g0 + 32 * i;
      if (g >= seg_end) continue;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        unsigned byte = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (!((valid[i] >> j) & 1u)) continue;
          const int v = scorer.score(r, base + 4 * g, j, kw[i]);
          byte |= (v > threshold[r] ? 2u : (v == threshold[r] ? 1u : 0u)) << (2 * j);
        }
        flags[r * groups + (g - first_group)] = static_cast<uint8_t>(byte);
        better[r] += __popc(byte & 0xaau);
        ties[r] += __popc(byte & 0x55u);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const unsigned bs = __reduce_add_sync(0xffffffffu, better[r]), ts = __reduce_add_sync(0xffffffffu, ties[r]);
    if (lane == 0) {
      segment_counts[warp][r][0] = static_cast<int32_t>(bs);
      segment_counts[warp][r][1] = static_cast<int32_t>(ts);
    }
  }
  __syncthreads();

  // 4. Pass b: per row, each warp writes its segment's entries in position order. Lanes hold
  // consecutive groups, so position order is (lane, j): an exclusive scan over the lanes of
  // (better | ties << 16) orders a tile's entries.
#pragma unroll 1
  for (int r = 0; r < kRows; ++r) {
    // 32-bit counters: a chunk holds at most kMaxChunkPositions entries (fewer instructions
    // than 64-bit ones in this, the kernel's busiest loop).
    int better_run = 0, ties_run = 0;  // this chunk's entries before the current tile
    for (int k = 0; k < warp; ++k) {
      better_run += segment_counts[k][r][0];
      ties_run += segment_counts[k][r][1];
    }
    const int chunk_skip = static_cast<int>(row_skip[r]);
    int32_t* out = p.indices + (first_row + r * p.rows) * p.width + row_offset[r];
    const uint8_t* row_flags = flags + r * groups - first_group;
    for (int64_t tile = seg_begin; tile < seg_end; tile += 32) {  // uniform trip count in the warp
      const int64_t g = tile + lane;
      const unsigned byte = g < seg_end ? row_flags[g] : 0u;
      const int mine = __popc(byte & 0xaau) | (__popc(byte & 0x55u) << 16);
      int inclusive = mine;
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
      }
      const int tile_total = __shfl_sync(0xffffffffu, inclusive, 31);
      if (byte != 0) {
        const int exclusive = inclusive - mine;
        int better_before = better_run + (exclusive & 0xffff);
        int ties_before = ties_run + (exclusive >> 16);
        const int32_t position = static_cast<int32_t>(base + 4 * g);  // output indices are int32
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const unsigned f = (byte >> (2 * j)) & 3u;
          if (f == 2u) {
            out[better_before + max(ties_before - chunk_skip, 0)] = position + j;
            ++better_before;
          } else if (f == 1u) {
            if (ties_before >= chunk_skip) out[better_before + ties_before - chunk_skip] = position + j;
            ++ties_before;
          }
        }
      }
      better_run += tile_total & 0xffff;
      ties_run += tile_total >> 16;
    }
  }
}

// ---- host side -------------------------------------------------------------------------------
template <int kRows, bool kSingleWord>
void launch_row_sets(const SelectionParams& p, const HammingSource& src, int64_t sequences_rows, int bins,
                     const at::Tensor& like) {
  const int64_t sets = sequences_rows / kRows;  // (B * Hs * L) / kRows row sets
  // Chunks: about kBlocksPerSm blocks per multiprocessor in all (the kernels are latency-bound:
  // Nsight Compute showed 2 blocks per SM leave both at ~25% occupancy), whole multiples of
  // kChunkQuantum positions, at most kMaxChunkPositions (8-bit counters) and 64 KB of flags per block.
  const int64_t max_chunk = std::min<int64_t>(kMaxChunkPositions, (int64_t(64) * 1024 * 4 / kRows) / kChunkQuantum *
                                                                     kChunkQuantum);
  int64_t chunks = std::max<int64_t>(1, ceil_div(kBlocksPerSm * int64_t(multiprocessor_count()), sets));
  int64_t chunk = ceil_div(ceil_div(p.keys, chunks), kChunkQuantum) * kChunkQuantum;
  const bool fills_gpu = ceil_div(p.keys, int64_t(kMinChunkPositions)) * sets >= multiprocessor_count();
  chunk = std::min(std::max<int64_t>(chunk, fills_gpu ? kMinChunkPositions : kChunkQuantum), max_chunk);
  chunks = std::max<int64_t>(1, ceil_div(p.keys, chunk));  // N = 0: one chunk writes the empty rows
  TORCH_CHECK(chunks <= 65535, "hamming_topk: ", as_text(p.keys), " keys are more than the selection grid handles");
  const FastLayout layout{chunk, chunks, bins, static_cast<int>(p.heads / kRows)};

  const int words = (bins + 3) / 4;
  const size_t q_bytes = sizeof(int32_t) * kRows * src.group * src.words;
  const size_t packed_bytes = sizeof(int32_t) * kRows * words * kThreads;
  const size_t warp_bytes = sizeof(int32_t) * kRows * bins * kWarps;
  const int mode = (bins <= kPackedMaxBins && packed_bytes <= 2 * kDefaultSmem) ? kPacked
                   : (warp_bytes <= 2 * kDefaultSmem)                           ? kPerWarp
                                                                                : kPerBlock;
  const size_t hist_smem = q_bytes + (mode == kPacked ? packed_bytes
                                                      : (mode == kPerWarp ? warp_bytes : sizeof(int32_t) * kRows * bins));
  const size_t compact_smem = sizeof(int32_t) * 2 * kRows * bins + q_bytes + size_t(kRows) * (chunk / 4);
  TORCH_CHECK(hist_smem <= 200 * 1024 && compact_smem <= 200 * 1024,
              "hamming_topk: internal shared-memory budget exceeded (", as_text(int64_t(hist_smem)), ", ",
              as_text(int64_t(compact_smem)), " bytes)");

  at::Tensor workspace = at::empty({sets * chunks * kRows * bins}, like.options().dtype(at::kInt));
  int32_t* histograms = workspace.data_ptr<int32_t>();
  auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(sets), static_cast<unsigned>(chunks));
  if (mode == kPacked) {
    allow_shared_memory(fast_histogram_kernel<kRows, kPacked, kSingleWord>, hist_smem);
    fast_histogram_kernel<kRows, kPacked, kSingleWord><<<grid, kThreads, hist_smem, stream>>>(p, src, layout, histograms);
  } else if (mode == kPerWarp) {
    allow_shared_memory(fast_histogram_kernel<kRows, kPerWarp, kSingleWord>, hist_smem);
    fast_histogram_kernel<kRows, kPerWarp, kSingleWord><<<grid, kThreads, hist_smem, stream>>>(p, src, layout, histograms);
  } else if constexpr (kRows == 1) {  // row sets of several rows always fit per-warp histograms
    allow_shared_memory(fast_histogram_kernel<kRows, kPerBlock, kSingleWord>, hist_smem);
    fast_histogram_kernel<kRows, kPerBlock, kSingleWord><<<grid, kThreads, hist_smem, stream>>>(p, src, layout, histograms);
  } else {
    TORCH_CHECK(false, "hamming_topk: internal error: row set histograms exceed shared memory");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  allow_shared_memory(fast_compact_kernel<kRows, kSingleWord>, compact_smem);
  fast_compact_kernel<kRows, kSingleWord><<<grid, kThreads, compact_smem, stream>>>(p, src, layout, histograms);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void launch_hamming_topk_fast(const SelectionParams& p, const HammingSource& src, int64_t row_count, int bins,
                              const at::Tensor& like) {
  // Rows sharing a key head: the selection heads of one KV head (per_key / group of them), when
  // a score needs just one key word. Row sets of 1, 2 or 4 rows (a divisor of that count; 8
  // sharing rows make two sets of 4: more instantiations would cost compile time for little).
  int rows_per_set = 1;
  if (src.words == 1 && src.shared_key_head) {
    const int sharing = src.per_key / src.group;
    for (int candidate : {4, 2}) {
      if (sharing % candidate == 0 && size_t(candidate) * bins * kWarps * sizeof(int32_t) <= 2 * kDefaultSmem) {
        rows_per_set = candidate;
        break;
      }
    }
  }
  if (!(src.words == 1 && src.shared_key_head)) return launch_row_sets<1, false>(p, src, row_count, bins, like);
  switch (rows_per_set) {
    case 4: return launch_row_sets<4, true>(p, src, row_count, bins, like);
    case 2: return launch_row_sets<2, true>(p, src, row_count, bins, like);
    default: return launch_row_sets<1, true>(p, src, row_count, bins, like);
  }
}

}  // namespace cuda
}  // namespace hashattention
