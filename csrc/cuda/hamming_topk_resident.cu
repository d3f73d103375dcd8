// One-launch exact top-k by counting, for selections small enough to stay on chip.
//
// The chunked path (hamming_topk_fast.cu) reads every key signature twice, in two launches: a
// histogram kernel, then a compaction kernel that scores its chunk again. At batch 1 a decode
// step's selection is small -- 32 heads x 128K positions is 16 MB of signatures, 4M scores --
// so its time went to the second read, the second launch and each phase's latency chain
// (H200, 128K: 10 + 17 us). Here one cooperative launch keeps every score in registers:
//   phase 1: each block loads its chunk of one row (one 16-byte load per four positions, all
//            issued before any is used), keeps the Hamming distances as bytes, four per
//            register, and counts them into a shared histogram with lane-private counters
//            (no same-address conflicts when distances cluster), then writes it to global memory;
//   grid-wide barrier;
//   phase 2: each block sums its row's chunk histograms (one bin per thread, from L2), finds by
//            one block scan the threshold distance T (the smallest with count(d <= T) >= m) and
//            how many of its ties to drop (the earliest), then flags its distances against T
//            four at a time (bytewise compares) and writes the selected positions in order:
//            a warp per contiguous segment, one warp scan per 128 positions.
// Distances, not scores, are counted: the best candidates have the smallest distance, so the
// counting runs from bin 0 upwards. Same output as every other path: position-sorted, ties at
// the threshold go to the later positions, windows, padding and counts as in
// write_fixed_part_of_row. The grid is sized from the occupancy the driver reports and launched
// cooperatively, which guarantees that all blocks are resident (the barrier cannot deadlock)
// and is captured by CUDA graphs like any kernel launch.
#include "hamming_topk_resident.h"

#include <cooperative_groups.h>

#include <cstdlib>
#include <cstring>

namespace hashattention {
namespace cuda {
namespace {

namespace cg = cooperative_groups;

constexpr unsigned kByteHigh = 0x80808080u;  // bit 7 of each byte
constexpr unsigned kOutside = 0xffu;         // distance byte of a position that is not a candidate
constexpr int kLoadBatch = 8;                // 16-byte loads in flight per thread

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

// Inclusive sum over the lanes of a warp.
__device__ __forceinline__ unsigned warp_inclusive_sum(unsigned value, int lane) {
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const unsigned other = __shfl_up_sync(0xffffffffu, value, offset);
    if (lane >= offset) value += other;
  }
  return value;
}

// kGroup: query heads per selection head (the distance of a position sums kGroup popcounts).
// kLoads: 16-byte loads per thread, so a block covers 4 * kLoads * kThreads positions.
template <int kGroup, int kLoads>
__global__ void __launch_bounds__(kThreads)
    resident_select_kernel(SelectionParams p, HammingSource src, int64_t chunks, int32_t* histograms) {
  constexpr int kBins = 32 * kGroup + 1;  // possible distances
  constexpr int64_t kChunk = int64_t(4) * kLoads * kThreads;
  constexpr int kSegment = 4 * kLoads * 32;  // positions per warp, contiguous
  static_assert(kBins <= kThreads && kBins < int(kOutside), "one bin per thread, distances fit a byte");
  static_assert(kLoads % kLoadBatch == 0 || kLoads < kLoadBatch, "whole load batches");
  static_assert(kChunk <= 32768, "a chunk's entry counts must fit 16 bits");
  __shared__ int32_t lane_counts[kBins * 32];  // [distance][lane]: lane-private counters
  __shared__ int32_t chunk_histogram[kBins];
  __shared__ int64_t scan_scratch[kWarps];
  __shared__ unsigned warp_entries[kWarps];
  __shared__ int32_t row_threshold;
  __shared__ int64_t row_better, row_better_before, row_ties_before, row_ties;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = blockIdx.x / chunks, chunk = blockIdx.x % chunks;  // row: (b * Hs + s) * L + l
  const int64_t l = row % p.rows, s = (row / p.rows) % p.heads, b = row / (p.rows * p.heads);
  const RowWindow w = p.window(b, l);
  const int64_t n = w.candidates(), m = w.heavy_budget;
  const int64_t base = chunk * kChunk;
  const int64_t lo = max64(w.sink_end, base), hi = min64(w.local_begin, base + kChunk);
  const bool scored = m > 0 && m < n && lo < hi;  // the same for every thread of the block
  const int64_t segment = base + int64_t(warp) * kSegment;

  // ---- phase 1: distances of the chunk, kept in registers, and their histogram ----
  unsigned distances[kLoads];  // byte j of distances[i]: position segment + 4 * (32 i + lane) + j
  if (scored) {
    unsigned q[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) q[g] = static_cast<unsigned>(src.q[b * src.qs0 + (s * kGroup + g) * src.qs1 + l * src.qs2]);
    const int32_t* key_row = src.k + b * src.ks0 + ((s * kGroup) / src.per_key) * src.ks1;
    for (int i = threadIdx.x; i < kBins * 32; i += kThreads) lane_counts[i] = 0;
    __syncthreads();
    constexpr int kBatch = kLoads < kLoadBatch ? kLoads : kLoadBatch;
#pragma unroll
    for (int i0 = 0; i0 < kLoads; i0 += kBatch) {
      int4 keys[kBatch];
      unsigned valid[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {  // all loads first: kBatch in flight per thread
        const int64_t position = segment + 4 * (int64_t(i0 + k) * 32 + lane);
        if (position >= lo && position + 4 <= hi) {
          keys[k] = __ldg(reinterpret_cast<const int4*>(key_row + position));
          valid[k] = 0xfu;
        } else {  // the row's first or last group of four, or outside it
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
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const unsigned key[4] = {unsigned(keys[k].x), unsigned(keys[k].y), unsigned(keys[k].z), unsigned(keys[k].w)};
        unsigned packed = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          unsigned distance = kOutside;
          if ((valid[k] >> j) & 1u) {
            distance = 0;
#pragma unroll
            for (int g = 0; g < kGroup; ++g) distance += __popc(q[g] ^ key[j]);
            atomicAdd(&lane_counts[distance * 32 + lane], 1);
          }
          packed |= distance << (8 * j);
        }
        distances[i0 + k] = packed;
      }
    }
    __syncthreads();
    if (threadIdx.x < kBins) {  // lanes visited in a rotated order: no bank conflicts
      const int bin = threadIdx.x;
      int32_t total = 0;
#pragma unroll 8
      for (int k = 0; k < 32; ++k) total += lane_counts[bin * 32 + ((k + bin) & 31)];
      chunk_histogram[bin] = total;
      histograms[(row * chunks + chunk) * kBins + bin] = total;
    }
  }

  cg::this_grid().sync();  // every chunk histogram is written (the barrier orders memory too)

  // ---- phase 2: threshold, then ordered compaction from the registers ----
  if (chunk == 0) write_fixed_part_of_row(p, row, w);
  if (m == 0 || lo >= hi) return;
  const int64_t heavy_offset = w.sink_end - w.start;  // heavy slot j of a row holds its j-th pick
  if (m == n) {  // every candidate is kept: no scores were needed
    int32_t* out = p.indices + row * p.width + heavy_offset;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) out[i - w.sink_end] = static_cast<int32_t>(i);
    return;
  }

  // Per bin: the row's count, and the count in the chunks before this one (one thread per bin).
  const int64_t c_first = w.sink_end / kChunk, c_last = (w.local_begin - 1) / kChunk;
  int64_t total = 0, before = 0;
  if (threadIdx.x < kBins) {
    const int32_t* h = histograms + row * chunks * kBins + threadIdx.x;
#pragma unroll 4
    for (int64_t c = c_first; c <= c_last; ++c) {
      const int32_t x = __ldcg(h + c * kBins);  // L2: written by other blocks in this launch
      total += x;
      before += c < chunk ? x : 0;
    }
  }
  // One scan of both counts (each < 2^31, so the halves never carry into each other): cumulative
  // counts of distances below each bin, in the row and before this chunk.
  constexpr int64_t kLow = 0xffffffffll;
  int64_t scan_total;
  const int64_t both = total | (before << 32);
  const int64_t exclusive = block_exclusive_scan(both, scan_scratch, scan_total);
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
  const int chunk_skip = static_cast<int>(min64(max64(skip - ties_before, 0), chunk_histogram[threshold]));
  int32_t* out = p.indices + row * p.width + heavy_offset + row_better_before + max64(ties_before - skip, 0);
  const unsigned threshold_bytes = unsigned(threshold) * 0x01010101u;

  // Entries (better | ties << 16) of each warp's segment, then each warp's start.
  unsigned entries = 0;
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    entries += __popc(bytes_less(distances[i], threshold_bytes)) |
               (__popc(bytes_equal(distances[i], threshold_bytes)) << 16);
  }
  entries = __reduce_add_sync(0xffffffffu, entries);
  if (lane == 0) warp_entries[warp] = entries;
  __syncthreads();
  unsigned run = 0;  // both halves fit 16 bits (kChunk <= 32K)
  for (int k = 0; k < warp; ++k) run += warp_entries[k];
  int better_run = static_cast<int>(run & 0xffffu), ties_run = static_cast<int>(run >> 16);

  // Position order inside a warp segment is (i, lane, j): one warp scan per i.
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const unsigned better = bytes_less(distances[i], threshold_bytes);
    const unsigned ties = bytes_equal(distances[i], threshold_bytes);
    const unsigned mine = __popc(better) | (__popc(ties) << 16);
    const unsigned inclusive = warp_inclusive_sum(mine, lane);
    const unsigned tile = __shfl_sync(0xffffffffu, inclusive, 31);
    if (better | ties) {
      const unsigned exclusive_entries = inclusive - mine;
      int better_before = better_run + static_cast<int>(exclusive_entries & 0xffffu);
      int ties_seen = ties_run + static_cast<int>(exclusive_entries >> 16);
      const int32_t position = static_cast<int32_t>(segment + 4 * (int64_t(i) * 32 + lane));  // indices are int32
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const unsigned bit = 0x80u << (8 * j);
        if (better & bit) {
          out[better_before + max(ties_seen - chunk_skip, 0)] = position + j;
          ++better_before;
        } else if (ties & bit) {
          if (ties_seen >= chunk_skip) out[better_before + ties_seen - chunk_skip] = position + j;
          ++ties_seen;
        }
      }
    }
    better_run += static_cast<int>(tile & 0xffffu);
    ties_run += static_cast<int>(tile >> 16);
  }
}

template <int kGroup, int kLoads>
bool try_launch(const SelectionParams& p, const HammingSource& src, int64_t row_count, const at::Tensor& like) {
  constexpr int64_t kChunk = int64_t(4) * kLoads * kThreads;
  constexpr int kBins = 32 * kGroup + 1;
  const auto kernel = resident_select_kernel<kGroup, kLoads>;
  const int64_t chunks = std::max<int64_t>(1, ceil_div(p.keys, kChunk));
  const int64_t blocks = row_count * chunks;
  // Resident blocks per multiprocessor: fixed by the kernel's registers and static shared memory
  // (and the architecture), so asked once per instantiation.
  static const int per_sm = [kernel] {
    int count = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, kernel, kThreads, 0));
    return count;
  }();
  if (blocks > int64_t(per_sm) * multiprocessor_count()) return false;

  at::Tensor workspace = at::empty({blocks * kBins}, like.options().dtype(at::kInt));
  int32_t* histograms = workspace.data_ptr<int32_t>();
  SelectionParams params = p;
  HammingSource source = src;
  int64_t chunk_count = chunks;
  void* args[] = {&params, &source, &chunk_count, &histograms};
  C10_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(static_cast<unsigned>(blocks)),
                                             dim3(kThreads), args, 0, at::cuda::getCurrentCUDAStream()));
  return true;
}

// The smallest block size (most blocks, so the most latency hidden) whose grid is resident.
// Capacity is set by the register file, about 4.3M positions on an H200 for every block size
// (sm_90: 4 loads per thread use ~50 registers, 8 use 63, 16 use 94, so 4 / 4 / 2 blocks of 4K
// / 8K / 16K positions per SM); 32 loads per thread (~200 registers, one block) would add
// nothing but compile time.
template <int kGroup>
bool launch_for_group(const SelectionParams& p, const HammingSource& src, int64_t row_count, const at::Tensor& like) {
  return try_launch<kGroup, 4>(p, src, row_count, like) || try_launch<kGroup, 8>(p, src, row_count, like) ||
         try_launch<kGroup, 16>(p, src, row_count, like);
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
  // Positions are int32 in the output; the chunk arithmetic above stays in range below that.
  if (p.keys >= (int64_t(1) << 31) || !supports_cooperative_launch()) return false;
  switch (src.group) {
    case 1: return launch_for_group<1>(p, src, row_count, like);
    case 2: return launch_for_group<2>(p, src, row_count, like);
    case 4: return launch_for_group<4>(p, src, row_count, like);
    default: return false;
  }
}

}  // namespace cuda
}  // namespace hashattention
