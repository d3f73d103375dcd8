// One-launch exact top-k by counting, for selections small enough to stay on chip.
//
// The chunked path (hamming_topk_fast.cu) reads every key signature twice, in two launches: a
// histogram kernel, then a compaction kernel that scores its chunk again. At batch 1 a decode
// step's selection is small -- 32 heads x 128K positions is 16 MB of signatures, 4M scores --
// so its time went to the second read, the second launch and each phase's latency chain
// (H200, 128K: 10 + 17 us). Here one cooperative launch keeps every distance on chip:
//   phase 1: each block loads its chunk of one row (16-byte loads of four positions, several in
//            flight per thread), writes the Hamming distances as bytes, in position order, to
//            shared memory, counts them with lane-private shared counters (no same-address
//            conflicts when distances cluster) and writes the chunk histogram to global memory;
//   grid-wide barrier;
//   phase 2: each block sums its row's chunk histograms (from L2), finds by one block scan the
//            threshold distance T (the smallest with count(d <= T) >= m) and how many of its
//            ties to drop (the earliest), then each thread takes a contiguous run of the
//            chunk's distances, counts its entries with bytewise compares (16 per shared load),
//            and after one block scan writes them in order.
// Nsight Compute on the first version (distances in registers, one warp scan per 128 positions
// in phase 2) showed ~2.3K instructions per warp with half the issue slots busy: the per-tile
// scans, 64-bit index arithmetic and per-position checks, not the bytes, set its time. Hence the
// thread-contiguous runs (one scan per block), 32-bit block coordinates and a check-free path
// for chunks inside the row's candidates.
// Distances, not scores, are counted: the best candidates have the smallest distance, so the
// counting runs from bin 0 upwards. Same output as every other path: position-sorted, ties at
// the threshold go to the later positions, windows, padding and counts as in
// write_fixed_part_of_row. The grid is sized from the occupancy the driver reports and launched
// cooperatively, which guarantees that all blocks are resident (the barrier cannot deadlock)
// and is captured by CUDA graphs like any kernel launch.
#include "hamming_topk_resident.h"

#include <cooperative_groups.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iterator>

namespace hashattention {
namespace cuda {
namespace {

namespace cg = cooperative_groups;

constexpr unsigned kByteHigh = 0x80808080u;  // bit 7 of each byte
constexpr unsigned kOutside = 0xffu;         // distance byte of a position that is not a candidate
constexpr int kLoadBatch = 4;                // 16-byte loads in flight per thread

// Bit 7 of byte i is set when byte i of x < byte i of y (unsigned), for all four bytes at once.
__device__ __forceinline__ unsigned bytes_less(unsigned x, unsigned y) {
  // Bit 7 of each byte: (x & 0x7f) >= (y & 0x7f). Every minuend byte is >= 0x80 and every
  // subtrahend byte <= 0x7f, so no byte borrows from the next.
  const unsigned low_at_least = (x | kByteHigh) - (y & ~kByteHigh);
  return ((~x & y) | (~(x ^ y) & ~low_at_least)) & kByteHigh;
}

// Bit 7 of byte i is set when byte i of x == byte i of y.
__device__ __forceinline__ unsigned bytes_equal(unsigned x, unsigned y) {
  const unsigned t = x ^ y;  // zero bytes where equal; adding 0x7f sets bit 7 of the others
  return ~(((t & ~kByteHigh) + ~kByteHigh) | t) & kByteHigh;
}

// Shared-memory slot of the chunk's 16-byte vector `vector` (16 distances). Phase 2 reads vector
// t * run + v in thread t, a stride of `run` vectors: unswizzled, the eight threads of a quarter
// warp would share banks (up to 8-way conflicts at run = 8). XOR-ing bits 3-5 into bits 0-2 is a
// bijection (an involution) that spreads those eight over all eight 16-byte bank groups for runs
// of 1 to 8 (2-way at 16), and keeps phase 1's consecutive 4-byte stores conflict-free.
__device__ __forceinline__ int swizzle(int vector) { return vector ^ ((vector >> 3) & 7); }

// Phase 2 of a chunk whose entries are exactly the distances below `limit_bytes` (a limit
// replicated in the four bytes): thread t counts the entries of its run of `run_vectors`
// 16-distance vectors (first_vector = t * run_vectors), one block scan gives each thread its
// offset, and it writes its entries' positions to out[offset...] in position order.
// Block-cooperative (every thread calls it).
__device__ __forceinline__ void compact_below(const uint4* vectors, const unsigned* words, int first_vector,
                                              int run_vectors, unsigned limit_bytes, int32_t* out,
                                              int first_position, int64_t* scan_scratch) {
  int count = 0;
  uint64_t words_with_entries = 0;  // bit 4 v + k: word k of vector v holds entries
  for (int v = 0; v < run_vectors; ++v) {
    const uint4 d = vectors[swizzle(first_vector + v)];
    const unsigned w[4] = {d.x, d.y, d.z, d.w};
    unsigned nibble = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const unsigned entries = bytes_less(w[k], limit_bytes);
      count += __popc(entries);
      nibble |= unsigned(entries != 0) << k;
    }
    words_with_entries |= uint64_t(nibble) << (4 * v);
  }
  int64_t total;
  int written = static_cast<int>(block_exclusive_scan(count, scan_scratch, total));
  while (words_with_entries != 0) {
    const int word = __ffsll(static_cast<long long>(words_with_entries)) - 1;
    words_with_entries &= words_with_entries - 1;
    const int v = word >> 2, k = word & 3;
    unsigned flagged = bytes_less(words[(swizzle(first_vector + v) << 2) | k], limit_bytes);
    const int position = first_position + v * 16 + 4 * k;
    while (flagged != 0) {  // bit 8 j + 7 set: position + j is an entry
      const int bit = __ffs(flagged) - 1;
      flagged &= flagged - 1;
      out[written++] = position + (bit >> 3);
    }
  }
}

// Where a block works: positions [base, base + chunk) of row (b * Hs + s) * L + l of the
// selection. The grid is (chunks, Hs * L, B), so that no 64-bit division runs per warp.
struct BlockCoordinates {
  int row, chunk_index, base;
  int b, s, l;
};

__device__ __forceinline__ BlockCoordinates block_coordinates(const SelectionParams& p, int chunk) {
  BlockCoordinates c;
  const int rows = static_cast<int>(p.rows), head_rows = static_cast<int>(blockIdx.y);
  c.chunk_index = static_cast<int>(blockIdx.x);
  c.base = c.chunk_index * chunk;
  c.b = static_cast<int>(blockIdx.z);
  c.s = rows == 1 ? head_rows : head_rows / rows;  // L = 1 at decode
  c.l = head_rows - c.s * rows;
  c.row = c.b * static_cast<int>(p.heads) * rows + head_rows;
  return c;
}

// Phase 1 for one block: the distance bytes of every position of its chunk, in position order
// (kOutside where the position is not a candidate of the row), and their histogram in
// lane-private counters. kInterior: the whole chunk lies inside [lo, hi), so no checks.
// Software-pipelined: the next batch of loads is issued before the current one is scored, so
// each thread keeps 2 * kLoadBatch 16-byte loads in flight (with ~4 resident blocks per
// multiprocessor, one batch alone left too few bytes in flight to cover DRAM latency at
// batch 4: 1.8 TB/s measured over the kernel, H200, 128K).
template <bool kInterior>
__device__ __forceinline__ void load_batch(const int32_t* key_row, int base, int g0, int lo, int hi,
                                           int4 (&keys)[kLoadBatch], unsigned (&valid)[kLoadBatch]) {
#pragma unroll
  for (int k = 0; k < kLoadBatch; ++k) {
    const int position = base + 4 * (g0 + k * kThreads);
    if (kInterior || (position >= lo && position + 4 <= hi)) {
      keys[k] = __ldg(reinterpret_cast<const int4*>(key_row + position));
      valid[k] = 0xfu;
    } else {  // the row's first or last group of four, or outside it: scalar loads, no reads outside
      int32_t word[4];
      valid[k] = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool inside = position + j >= lo && position + j < hi;
        word[j] = inside ? __ldg(key_row + position + j) : 0;
        valid[k] |= unsigned(inside) << j;
      }
      keys[k] = make_int4(word[0], word[1], word[2], word[3]);
    }
  }
}

template <int kGroup, bool kInterior>
__device__ __forceinline__ void score_batch(const unsigned (&q)[kGroup], int g0, const int4 (&keys)[kLoadBatch],
                                            const unsigned (&valid)[kLoadBatch], unsigned* distance_words,
                                            int32_t* lane_counts) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 0; k < kLoadBatch; ++k) {
    const unsigned key[4] = {unsigned(keys[k].x), unsigned(keys[k].y), unsigned(keys[k].z), unsigned(keys[k].w)};
    unsigned packed = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      unsigned distance = 0;
#pragma unroll
      for (int g = 0; g < kGroup; ++g) distance += __popc(q[g] ^ key[j]);
      if (kInterior || ((valid[k] >> j) & 1u)) {
        atomicAdd(&lane_counts[distance * 32 + lane], 1);
      } else {
        distance = kOutside;
      }
      packed |= distance << (8 * j);
    }
    const int g = g0 + k * kThreads;
    distance_words[(swizzle(g >> 2) << 2) | (g & 3)] = packed;
  }
}

template <int kGroup, bool kInterior>
__device__ __forceinline__ void score_chunk(const unsigned (&q)[kGroup], const int32_t* key_row, int base, int chunk,
                                            int lo, int hi, unsigned* distance_words, int32_t* lane_counts) {
  constexpr int kStride = kThreads * kLoadBatch;
  const int groups = chunk / 4;  // a multiple of kStride
  int4 keys[kLoadBatch], next_keys[kLoadBatch];
  unsigned valid[kLoadBatch], next_valid[kLoadBatch];
  load_batch<kInterior>(key_row, base, threadIdx.x, lo, hi, keys, valid);
  for (int g0 = threadIdx.x; g0 < groups; g0 += kStride) {
    const bool more = g0 + kStride < groups;  // the same for every thread
    if (more) load_batch<kInterior>(key_row, base, g0 + kStride, lo, hi, next_keys, next_valid);
    score_batch<kGroup, kInterior>(q, g0, keys, valid, distance_words, lane_counts);
    if (more) {
#pragma unroll
      for (int k = 0; k < kLoadBatch; ++k) {
        keys[k] = next_keys[k];
        valid[k] = next_valid[k];
      }
    }
  }
}

// kGroup: query heads per selection head (the distance of a position sums kGroup popcounts).
// Dynamic shared memory: `chunk` distance bytes.
template <int kGroup>
__global__ void __launch_bounds__(kThreads)
    resident_select_kernel(SelectionParams p, HammingSource src, int chunk, int32_t* histograms) {
  constexpr int kBins = 32 * kGroup + 1;  // possible distances
  constexpr int kParts = kThreads / kBins;  // threads summing one bin's chunk histograms
  static_assert(kBins <= kThreads && kBins < int(kOutside), "one bin per thread, distances fit a byte");
  extern __shared__ uint4 dynamic_smem[];
  unsigned* distance_words = reinterpret_cast<unsigned*>(dynamic_smem);  // chunk / 4 words
  __shared__ int32_t lane_counts[kBins * 32];  // [distance][lane]: lane-private counters
  __shared__ int32_t chunk_histogram[kBins];
  __shared__ int64_t scan_scratch[kWarps];
  __shared__ int32_t row_threshold;
  __shared__ int64_t row_better, row_better_before, row_ties_before, row_ties;

  const BlockCoordinates at = block_coordinates(p, chunk);
  const int chunks = static_cast<int>(gridDim.x);
  const RowWindow w = p.window(at.b, at.l);
  const int64_t n = w.candidates(), m = w.heavy_budget;
  const int lo = static_cast<int>(max64(w.sink_end, at.base));
  const int hi = static_cast<int>(min64(w.local_begin, int64_t(at.base) + chunk));
  const bool scored = m > 0 && m < n && lo < hi;  // the same for every thread of the block

  // ---- phase 1: distances of the chunk into shared memory, and their histogram ----
  if (scored) {
    unsigned q[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      q[g] = static_cast<unsigned>(src.q[at.b * src.qs0 + (int64_t(at.s) * kGroup + g) * src.qs1 + at.l * src.qs2]);
    }
    const int32_t* key_row = src.k + at.b * src.ks0 + ((int64_t(at.s) * kGroup) / src.per_key) * src.ks1;
    for (int i = threadIdx.x; i < kBins * 32; i += kThreads) lane_counts[i] = 0;
    __syncthreads();
    if (lo == at.base && hi == at.base + chunk) {
      score_chunk<kGroup, true>(q, key_row, at.base, chunk, lo, hi, distance_words, lane_counts);
    } else {
      score_chunk<kGroup, false>(q, key_row, at.base, chunk, lo, hi, distance_words, lane_counts);
    }
    __syncthreads();
    if (threadIdx.x < kBins) {  // lanes visited in a rotated order: no bank conflicts
      const int bin = threadIdx.x;
      int32_t total = 0;
#pragma unroll 8
      for (int k = 0; k < 32; ++k) total += lane_counts[bin * 32 + ((k + bin) & 31)];
      chunk_histogram[bin] = total;
      histograms[(int64_t(at.row) * chunks + at.chunk_index) * kBins + bin] = total;
    }
  }

  cg::this_grid().sync();  // every chunk histogram is written (the barrier orders memory too)

  // ---- phase 2: threshold, then ordered compaction from shared memory ----
  if (at.chunk_index == 0) write_fixed_part_of_row(p, at.row, w);
  if (m == 0 || lo >= hi) return;
  const int64_t heavy_offset = w.sink_end - w.start;  // heavy slot j of a row holds its j-th pick
  int32_t* row_out = p.indices + int64_t(at.row) * p.width + heavy_offset;
  if (m == n) {  // every candidate is kept: no scores were needed
    for (int i = lo + threadIdx.x; i < hi; i += kThreads) row_out[i - w.sink_end] = i;
    return;
  }

  // Per bin: the row's count, and the count in the chunks before this one. kParts threads per
  // bin each sum every kParts-th chunk (loads from L2: written by other blocks in this launch),
  // then combine their sums through shared memory (lane_counts is free again).
  const int c_first = static_cast<int>(w.sink_end / chunk), c_last = static_cast<int>((w.local_begin - 1) / chunk);
  const int bin = threadIdx.x % kBins, part = threadIdx.x / kBins;
  int32_t* part_sums = lane_counts;  // [part][bin][total, before]
  __syncthreads();  // lane_counts was last read in phase 1
  if (part < kParts) {
    const int32_t* h = histograms + int64_t(at.row) * chunks * kBins + bin;
    int32_t total = 0, before = 0;
    for (int c = c_first + part; c <= c_last; c += kParts) {
      const int32_t x = __ldcg(h + int64_t(c) * kBins);
      total += x;
      before += c < at.chunk_index ? x : 0;
    }
    part_sums[(part * kBins + bin) * 2] = total;
    part_sums[(part * kBins + bin) * 2 + 1] = before;
  }
  __syncthreads();
  int64_t total = 0, before = 0;
  if (threadIdx.x < kBins) {
#pragma unroll
    for (int k = 0; k < kParts; ++k) {
      total += part_sums[(k * kBins + threadIdx.x) * 2];
      before += part_sums[(k * kBins + threadIdx.x) * 2 + 1];
    }
  }
  // One scan of both counts (each < 2^31, so the halves never carry into each other): counts of
  // the distances below each bin, in the row and in the chunks before this one.
  constexpr int64_t kLow = 0xffffffffll;
  int64_t scan_total;
  const int64_t exclusive = block_exclusive_scan(total | (before << 32), scan_scratch, scan_total);
  if (threadIdx.x < kBins) {
    const int64_t below = exclusive & kLow;
    if (below < m && below + total >= m) {  // exactly one bin: 0 < m < n
      row_threshold = threadIdx.x;
      row_better = below;
      row_better_before = exclusive >> 32;
      row_ties_before = before;
      row_ties = total;
    }
  }
  __syncthreads();
  const int threshold = row_threshold;
  const int64_t skip = row_ties - (m - row_better);  // the earliest ties at T are dropped
  const int64_t ties_before = row_ties_before;
  int32_t* out = row_out + row_better_before + max64(ties_before - skip, 0);

  // Thread t owns positions [base + t * run, base + (t + 1) * run): count its entries, one block
  // scan orders the threads, then each thread writes its own entries in order. The first pass
  // notes which of its words hold entries (~5% of positions are entries at 32x), so the second
  // visits only those. Ties at T are dropped earliest first, so every chunk but (at most) the one
  // where the dropping stops either keeps all its ties or none: there, an entry is simply a
  // distance below a limit (T + 1 or T), one compare per word; only that boundary chunk counts
  // better entries and ties apart.
  const int run_vectors = chunk / (16 * kThreads);  // 16 distances per 16-byte shared load; <= 16
  const int first_vector = threadIdx.x * run_vectors;
  const int chunk_ties = chunk_histogram[threshold];
  if (ties_before >= skip || ties_before + chunk_ties <= skip) {  // block-uniform
    const unsigned limit = ties_before >= skip ? unsigned(threshold) + 1 : unsigned(threshold);
    compact_below(dynamic_smem, distance_words, first_vector, run_vectors, limit * 0x01010101u, out,
                  at.base + first_vector * 16, scan_scratch);
    return;
  }
  const int chunk_skip = static_cast<int>(skip - ties_before);  // in (0, chunk_ties)
  const unsigned threshold_bytes = unsigned(threshold) * 0x01010101u;
  int better_count = 0, tie_count = 0;
  uint64_t words_with_entries = 0;  // bit 4 v + k: word k of vector v
  for (int v = 0; v < run_vectors; ++v) {
    const uint4 d = dynamic_smem[swizzle(first_vector + v)];
    const unsigned words[4] = {d.x, d.y, d.z, d.w};
    unsigned nibble = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int better = __popc(bytes_less(words[k], threshold_bytes));
      const int ties = __popc(bytes_equal(words[k], threshold_bytes));
      better_count += better;
      tie_count += ties;
      nibble |= unsigned((better | ties) != 0) << k;
    }
    words_with_entries |= uint64_t(nibble) << (4 * v);
  }
  const int64_t entries = better_count | (int64_t(tie_count) << 32);
  const int64_t entries_before = block_exclusive_scan(entries, scan_scratch, scan_total);
  int better_before = static_cast<int>(entries_before & kLow);
  int ties_seen = static_cast<int>(entries_before >> 32);
  while (words_with_entries != 0) {
    const int word = __ffsll(static_cast<long long>(words_with_entries)) - 1;
    words_with_entries &= words_with_entries - 1;
    const int v = word >> 2, k = word & 3;
    const unsigned d = distance_words[(swizzle(first_vector + v) << 2) | k];
    const unsigned better = bytes_less(d, threshold_bytes);
    unsigned flagged = better | bytes_equal(d, threshold_bytes);
    const int position = at.base + (first_vector + v) * 16 + 4 * k;
    while (flagged != 0) {  // bit 8 j + 7 set: position + j is an entry
      const int bit = __ffs(flagged) - 1;
      flagged &= flagged - 1;
      if ((better >> bit) & 1u) {
        out[better_before + max(ties_seen - chunk_skip, 0)] = position + (bit >> 3);
        ++better_before;
      } else {
        if (ties_seen >= chunk_skip) out[better_before + ties_seen - chunk_skip] = position + (bit >> 3);
        ++ties_seen;
      }
    }
  }
}

// Chunk sizes, multiples of 4 * kThreads * kLoadBatch positions. Capacity is set by shared memory
// (a byte per position): about 25M positions on an H200.
constexpr int kChunkSizes[] = {4096, 8192, 16384, 32768, 65536};
// Preferred grid: the smallest chunks that make at most this many blocks per multiprocessor (as
// the chunked path, whose kernels were measured latency-bound with fewer); more, smaller blocks
// only add per-block work (prologue, histogram sums, barrier arrivals).
constexpr int kPreferredBlocksPerSm = 4;

template <int kGroup>
bool launch_for_group(const SelectionParams& p, const HammingSource& src, int64_t row_count, const at::Tensor& like) {
  constexpr int kBins = 32 * kGroup + 1;
  const auto kernel = resident_select_kernel<kGroup>;
  const int64_t sms = multiprocessor_count();
  // Resident blocks per multiprocessor for each chunk size: fixed by the kernel and the
  // architecture, so asked from the driver once (-1: not yet).
  static std::atomic<int> resident_per_sm[] = {-1, -1, -1, -1, -1};
  static_assert(std::size(resident_per_sm) == std::size(kChunkSizes), "one count per chunk size");
  int chosen = -1;  // index into kChunkSizes
  for (size_t i = 0; i < std::size(kChunkSizes); ++i) {
    const int64_t grid = row_count * std::max<int64_t>(1, ceil_div(p.keys, kChunkSizes[i]));
    int per_sm = resident_per_sm[i].load();
    if (per_sm < 0) {
      allow_shared_memory(kernel, kChunkSizes[i]);
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, kChunkSizes[i]));
      resident_per_sm[i] = per_sm;
    }
    if (grid > int64_t(per_sm) * sms) continue;  // not resident: the barrier would deadlock
    if (chosen < 0) chosen = static_cast<int>(i);  // the smallest resident chunk, unless one below is preferred
    if (grid <= kPreferredBlocksPerSm * sms) {
      chosen = static_cast<int>(i);
      break;
    }
  }
  if (chosen < 0) return false;
  int chunk = kChunkSizes[chosen];
  const int64_t chunks = std::max<int64_t>(1, ceil_div(p.keys, chunk));
  allow_shared_memory(kernel, chunk);
  at::Tensor workspace = at::empty({row_count * chunks * kBins}, like.options().dtype(at::kInt));
  int32_t* histograms = workspace.data_ptr<int32_t>();
  SelectionParams params = p;
  HammingSource source = src;
  void* args[] = {&params, &source, &chunk, &histograms};
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(p.heads * p.rows),
                  static_cast<unsigned>(row_count / (p.heads * p.rows)));
  C10_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), grid, dim3(kThreads), args,
                                             static_cast<size_t>(chunk), at::cuda::getCurrentCUDAStream()));
  return true;
}

bool supports_cooperative_launch() {
  int device = 0, supported = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&supported, cudaDevAttrCooperativeLaunch, device));
  return supported != 0;
}

}  // namespace

bool launch_hamming_topk_resident(const SelectionParams& p, const HammingSource& src, int64_t row_count,
                                  const at::Tensor& like) {
  const char* path = std::getenv("HASHATTENTION_SELECTION");
  if (path != nullptr && std::strcmp(path, "chunked") == 0) return false;
  if (src.words != 1 || !src.vector_keys || !src.shared_key_head) return false;
  // 32-bit positions, rows and block coordinates in the kernel (output positions are int32);
  // grid (chunks, Hs * L, B) within CUDA's limits.
  if (p.keys > (int64_t(1) << 30) || row_count >= (int64_t(1) << 31) || p.heads * p.rows > 65535 ||
      row_count / (p.heads * p.rows) > 65535 || !supports_cooperative_launch()) {
    return false;
  }
  switch (src.group) {
    case 1: return launch_for_group<1>(p, src, row_count, like);
    case 2: return launch_for_group<2>(p, src, row_count, like);
    case 4: return launch_for_group<4>(p, src, row_count, like);
    default: return false;
  }
}

}  // namespace cuda
}  // namespace hashattention
