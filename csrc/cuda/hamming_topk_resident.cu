// One-launch exact top-k by counting, for selections small enough to stay on chip.
//
// The chunked path (hamming_topk_fast.cu) reads every key signature twice, in two launches: a
// histogram kernel, then a compaction kernel that scores its chunk again. At batch 1 a decode
// step's selection is small -- 32 heads x 128K positions is 16 MB of signatures, 4M scores --
// so its time went to the second read, the second launch and each phase's latency chain
// (H200, 128K: 10 + 17 us). Here one cooperative launch keeps every distance on chip (a problem
// larger than one resident grid takes several such launches, each over whole batches or head rows):
//   phase 1: each block loads its chunk of one row (16-byte loads of four positions, two
//            batches in flight per thread), writes the Hamming distances as bytes, in position
//            order, to shared memory, counts them with lane-private shared counters (no
//            same-address conflicts when distances cluster) and writes the chunk histogram to
//            global memory;
//   grid-wide barrier;
//   phase 2: each block sums its row's chunk histograms (from L2), finds by one warp scan the
//            threshold distance T (the smallest with count(d <= T) >= m) and how many of its
//            ties to drop (the earliest); each warp reads its contiguous segment of the chunk
//            once, 512 positions per step (a 16-byte shared load per lane), keeping each lane's
//            entry bits in registers, scans the lanes' counts of all steps together, takes its
//            offset from the other warps' counts and writes its entries in position order
//            (RegisterEntries; 64K-position chunks read the segment twice, counting, then
//            writing with one warp scan per step).
// Phase times with the two-pass phase 2 (the kernel stopped after each phase; H200, B = 4, 128K,
// 32 heads, 32x, 38.8 us in all): scoring 24.4 us (2.75 TB/s over the signatures; it includes the
// launch and the prologue), barrier 0.9, threshold 2.0, warp counts 2.2, writes 9.2. The write
// pass's time follows the number of entries, not positions (B = 1 at 512K, the same number of
// entries, 7.6 us). Staging each warp's entries in shared memory for contiguous stores measured the
// same 9.1 us (and was not kept), so whether the scattered stores cost that time is open.
// Thread-contiguous runs in phase 2 (lanes' write loops of different trip counts) with one block
// scan took 41.3 us.
// Distances, not scores, are counted: the best candidates have the smallest distance, so the
// counting runs from bin 0 upwards. Same output as every other path: position-sorted, ties at
// the threshold go to the later positions, windows, padding and counts as in
// write_fixed_part_of_row. The grid is sized from the occupancy the driver reports and launched
// cooperatively, which guarantees that all blocks are resident (the barrier cannot deadlock)
// and is captured by CUDA graphs like any kernel launch.
#include "hamming_topk_resident.h"

#include <cooperative_groups.h>

#include <atomic>
#include <iterator>

#include "environment_overrides.h"

namespace hashattention {
namespace cuda {
namespace {

namespace cg = cooperative_groups;

constexpr unsigned kByteHigh = 0x80808080u;  // bit 7 of each byte
constexpr int kLoadBatch = 4;                // 16-byte loads per thread and batch

// Bit 7 of byte i is set when byte i of x == byte i of y.
__device__ __forceinline__ unsigned bytes_equal(unsigned x, unsigned y) {
  const unsigned t = x ^ y;  // zero bytes where equal; adding 0x7f sets bit 7 of the others
  return ~(((t & ~kByteHigh) + ~kByteHigh) | t) & kByteHigh;
}

// The distance bytes of a selection with kGroup query heads per selection head: distances
// 0 .. 32 kGroup, and kOutside for a position that is not a candidate of the row.
template <int kGroup>
struct DistanceBytes {
  // Up to two heads every byte stays below 0x80, which makes the compare two instructions.
  static constexpr unsigned kOutside = kGroup <= 2 ? 0x7fu : 0xffu;
  static_assert(32 * kGroup < int(kOutside), "distances fit a byte below kOutside");

  // Bit 7 of byte i is set when byte i of x < the limit in every byte of limit_bytes (<= kOutside).
  static __device__ __forceinline__ unsigned less(unsigned x, unsigned limit_bytes) {
    if constexpr (kGroup <= 2) {
      // x + 0x80 - limit per byte (x <= 0x7f, 1 <= limit <= 0x80): no carries, bit 7 set when x >= limit.
      return ~(x + (kByteHigh - limit_bytes)) & kByteHigh;
    } else {
      // Bit 7 of each byte: (x & 0x7f) >= (y & 0x7f). Every minuend byte is >= 0x80 and every
      // subtrahend byte <= 0x7f, so no byte borrows from the next.
      const unsigned low_at_least = (x | kByteHigh) - (limit_bytes & ~kByteHigh);
      return ((~x & limit_bytes) | (~(x ^ limit_bytes) & ~low_at_least)) & kByteHigh;
    }
  }
};

// The four bit-7 flags of a word (as from DistanceBytes::less) as bits 0-3.
__device__ __forceinline__ unsigned flags_to_bits(unsigned flags) {
  return (flags * 0x00204081u) >> 28;  // bits 7, 15, 23, 31 land on 28-31; nothing carries
}

// Where a block works: positions [base, base + chunk) of row (b * Hs + s) * L + l of the
// selection. The grid is (chunks, Hs * L, B), or a slice of it: blocks of a launch that serves
// head rows [offset.x, ...) of batches [offset.y, ...) (see launch_for_group) add the offsets. So no
// 64-bit division runs per warp.
struct BlockCoordinates {
  int row, chunk_index, base;
  int b, s, l;
};

__device__ __forceinline__ BlockCoordinates block_coordinates(const SelectionParams& p, int chunk, int2 offset) {
  BlockCoordinates c;
  const int rows = static_cast<int>(p.rows), head_rows = static_cast<int>(blockIdx.y) + offset.x;
  c.chunk_index = static_cast<int>(blockIdx.x);
  c.base = c.chunk_index * chunk;
  c.b = static_cast<int>(blockIdx.z) + offset.y;
  c.s = rows == 1 ? head_rows : head_rows / rows;  // L = 1 at decode
  c.l = head_rows - c.s * rows;
  c.row = c.b * static_cast<int>(p.heads) * rows + head_rows;
  return c;
}

// Phase 1's loads. Batch j of thread t holds groups (j * kLoadBatch + k) * kThreads + t of the
// chunk (groups of four positions), so each load instruction of a block reads 4 KB contiguous
// bytes. (Warp-contiguous segments instead -- eight streams per block -- made phase 1 ~20%
// slower at 32K-position chunks, H200.) The loads are unconditional: batch indices past the last
// batch (the prefetch after it) repeat that batch, and positions past `last_position` (the last
// whole group of four inside the chunk and the signatures) read it instead, so the batch
// registers never wait behind a select or a branch.
struct ChunkLoads {
  const int32_t* key_row;
  int base;            // the chunk's first position
  int last_batch;      // batches 0 .. last_batch
  int last_position;   // a multiple of 4

  __device__ __forceinline__ int group(int batch, int k) const {
    return (batch * kLoadBatch + k) * kThreads + threadIdx.x;
  }

  __device__ __forceinline__ void load(int batch, int4 (&keys)[kLoadBatch]) const {
    batch = min(batch, last_batch);
#pragma unroll
    for (int k = 0; k < kLoadBatch; ++k) {
      const int position = min(base + 4 * group(batch, k), last_position);
      keys[k] = __ldg(reinterpret_cast<const int4*>(key_row + position));
    }
  }
};

// Phase 1's counters: one per distance and lane (same-address conflicts would serialise the
// atomics when distances cluster).
template <int kGroup>
struct PhaseOneCounters {
  static constexpr int kBins = 32 * kGroup + 1;
  static constexpr int kWords = kBins * 32;
  uint32_t* words;  // shared memory, [distance][lane]

  __device__ __forceinline__ void add(unsigned distance) const {
    atomicAdd(&words[distance * 32 + (threadIdx.x & 31)], 1u);
  }
  // Takes back one count of `distance` (the column sums wrap; their total over the lanes does not).
  __device__ __forceinline__ void remove(unsigned distance) const {
    atomicAdd(&words[distance * 32 + (threadIdx.x & 31)], ~0u);
  }
};

// Scores one batch into the chunk's distance bytes and counters, every position of the batch
// alike: positions outside the row's candidates [lo, hi) and the signatures' partial last group
// are corrected afterwards by mask_chunk_edges.
template <int kGroup>
__device__ __forceinline__ void score_batch(const unsigned (&q)[kGroup], const ChunkLoads& at, int batch,
                                            const int4 (&keys)[kLoadBatch], unsigned* distance_words,
                                            const PhaseOneCounters<kGroup>& counters) {
#pragma unroll
  for (int k = 0; k < kLoadBatch; ++k) {
    const unsigned key[4] = {unsigned(keys[k].x), unsigned(keys[k].y), unsigned(keys[k].z), unsigned(keys[k].w)};
    unsigned packed = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      unsigned distance = 0;
#pragma unroll
      for (int h = 0; h < kGroup; ++h) distance += __popc(q[h] ^ key[j]);
      counters.add(distance);
      packed |= distance << (8 * j);
    }
    distance_words[at.group(batch, k)] = packed;  // lanes store consecutive words: no bank conflicts
  }
}

// The chunk's positions that are not candidates of the row -- before `lo` (the sink window,
// earlier chunks' rows) and from `hi` on (the local window, unwritten slots, past the signatures)
// -- leave the counts and become kOutside; the valid positions of the signatures' partial last
// group (keys4 .. hi - 1, at most three), which the clamped loads scored with the group before
// it, get their own distances. Scoring every chunk alike and correcting its edges here replaced
// a masked scoring path for the first and last chunks of a row, which ran ~40% slower than the
// interior one (H200, B = 4 / 128K / 32x per query head: 22-27 us of phase 1 for those blocks
// against 13-20 us for the others, per-block timings) and so set when every block passed the grid
// barrier. Call from every thread, after a barrier.
template <int kGroup>
__device__ __forceinline__ void mask_chunk_edges(const unsigned (&q)[kGroup], const int32_t* key_row, int base,
                                                 int chunk, int lo, int hi, int keys4, unsigned* distance_words,
                                                 const PhaseOneCounters<kGroup>& counters) {
  auto* bytes = reinterpret_cast<unsigned char*>(distance_words);
  const auto take_out = [&](int from, int to) {  // chunk offsets [from, to)
    for (int i = from + static_cast<int>(threadIdx.x); i < to; i += kThreads) {
      counters.remove(bytes[i]);
      bytes[i] = DistanceBytes<kGroup>::kOutside;
    }
  };
  take_out(0, lo - base);
  take_out(hi - base, chunk);
  const int position = max(keys4, lo) + static_cast<int>(threadIdx.x);
  if (position < hi && threadIdx.x < 4) {
    const unsigned key = static_cast<unsigned>(__ldg(key_row + position));
    unsigned distance = 0;
#pragma unroll
    for (int h = 0; h < kGroup; ++h) distance += __popc(q[h] ^ key);
    counters.remove(bytes[position - base]);
    counters.add(distance);
    bytes[position - base] = static_cast<unsigned char>(distance);
  }
}

// Phase 1 of a block. Double-buffered with two register batches A and B and no copies between
// them: B's loads are issued before A is scored, A's next loads before B is scored, so a thread
// always has one or two batches in flight. Batch A of the first pass is loaded by the caller
// (before the row's window is read). With the prefetch behind a branch and a copy next -> current,
// the compiler turned the copy into selects that waited for the loads just issued, and with B
// scored behind a branch ptxas moved B's loads into that branch,
// just before their use: either way one batch was in flight (Nsight Compute: a third of the warp
// stalls on those instructions).
template <int kGroup>
__device__ __forceinline__ void score_chunk(const unsigned (&q)[kGroup], const ChunkLoads& at, int4 (&a)[kLoadBatch],
                                            unsigned* distance_words, const PhaseOneCounters<kGroup>& counters) {
  if (at.last_batch == 0) {  // one batch per thread (chunk 4096): nothing to overlap
    score_batch<kGroup>(q, at, 0, a, distance_words, counters);
    return;
  }
  int4 b[kLoadBatch];
  for (int batch = 0; batch <= at.last_batch; batch += 2) {  // an even number of batches
    at.load(batch + 1, b);
    score_batch<kGroup>(q, at, batch, a, distance_words, counters);
    at.load(batch + 2, a);  // past the last batch: repeats it (cached), never scored
    score_batch<kGroup>(q, at, batch + 1, b, distance_words, counters);
  }
}

// Writes position + i to o[0], o[1], ... for each set bit i of `bits`, lowest first.
__device__ __forceinline__ void write_positions(unsigned bits, int position, int32_t* o) {
  while (bits != 0) {
    const int bit = __ffs(bits) - 1;
    bits &= bits - 1;
    *o++ = position + bit;
  }
}

// The entry bits of one lane's 16-position vector of distance bytes (bit i: position 16 vector + i):
// distances below `limit_bytes`, and with kSplitTies the ties at `threshold_bytes` apart.
template <int kGroup, bool kSplitTies>
__device__ __forceinline__ void vector_entry_bits(const uint4& d, unsigned limit_bytes, unsigned threshold_bytes,
                                                  unsigned& better, unsigned& ties) {
  const unsigned words[4] = {d.x, d.y, d.z, d.w};
  better = 0;
  ties = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    better |= flags_to_bits(DistanceBytes<kGroup>::less(words[k], limit_bytes)) << (4 * k);
    if constexpr (kSplitTies) ties |= flags_to_bits(bytes_equal(words[k], threshold_bytes)) << (4 * k);
  }
}

// A lane's ties at T that the boundary chunk keeps, given the chunk rank of its first tie: the
// chunk's first chunk_skip ties are dropped, so the lane holding the cut clears its lowest dropped
// ones (the only loop) and every other lane keeps all or none.
__device__ __forceinline__ unsigned kept_ties(unsigned ties, int tie_rank, int chunk_skip) {
  int drop = chunk_skip - tie_rank;
  unsigned kept = drop >= __popc(ties) ? 0u : ties;
  for (; drop > 0 && kept != 0; --drop) kept &= kept - 1;
  return kept;
}

// Phase 2 of one warp: writes the entries of its segment (`steps` x 512 positions from
// `first_vector`, 16-position vectors of distance bytes) in position order. Entries: distances
// below `limit`; with kSplitTies, distances below `threshold` plus the ties at `threshold` from
// the chunk's `chunk_skip`-th on, where the warp's better entries and ties start at out[better_base
// + ...] and tie number ties_base, as in the other paths (out[better + max(ties - skip, 0)]).
template <int kGroup, bool kSplitTies>
__device__ __forceinline__ void write_warp_entries(const uint4* vectors, int first_vector, int steps, int first_position,
                                                   unsigned limit_bytes, unsigned threshold_bytes, int chunk_skip,
                                                   int better_base, int ties_base, int32_t* out) {
  const int lane = threadIdx.x & 31;
  for (int step = 0; step < steps; ++step) {
    const int vector = first_vector + step * 32 + lane;
    unsigned better, ties;
    vector_entry_bits<kGroup, kSplitTies>(vectors[vector], limit_bytes, threshold_bytes, better, ties);
    // Inclusive warp scan of both counts (each <= 16 per lane, <= 512 per warp: 16-bit halves).
    const unsigned own = __popc(better) | (kSplitTies ? unsigned(__popc(ties)) << 16 : 0u);
    unsigned inclusive = own;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const unsigned other = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += other;
    }
    const unsigned before = inclusive - own, step_total = __shfl_sync(0xffffffffu, inclusive, 31);
    const int position = first_position + vector * 16;
    if constexpr (!kSplitTies) {
      write_positions(better, position, out + better_base + int(before));
    } else {
      // Every lane writes its kept entries consecutively from better entries before it + kept
      // ties before it, as the uniform path does. (Deciding tie by tie instead made the boundary
      // blocks' writes ~1.8x the others' at B = 4 / 128K, per-block timings.)
      const int tie_rank = ties_base + int(before >> 16);
      write_positions(better | kept_ties(ties, tie_rank, chunk_skip), position,
                      out + better_base + int(before & 0xffffu) + max(tie_rank - chunk_skip, 0));
    }
    better_base += int(step_total & 0xffffu);
    ties_base += int(step_total >> 16);
  }
}

// Phase 2 of one warp for chunks of at most kMaxRegisterSteps 512-position steps per warp (chunks
// up to 32K positions, which every decode shape of the benchmarks uses): ONE
// pass over the warp's distance bytes keeps each lane's entry masks in registers (16 bits of
// entries and, in the boundary chunk, 16 bits of ties at T per step), the lanes' counts of all
// steps are scanned together (three steps per 32-bit word, a 10-bit field each: a step's count over
// the warp is at most 512), and the writes come from the registers. The general path
// (the kernel's counting loop + write_warp_entries) reads the bytes twice, recomputes the flags and scans
// once per step; phase 2 runs with DRAM idle and is bound by its instruction count (H200, B = 4 /
// 128K / 32x per query head, two-pass: counts 2.0 + writes 7.7 us of the 33.7).
constexpr int kMaxRegisterSteps = 8;
constexpr int kFieldBits = 10;
constexpr unsigned kFieldMask = (1u << kFieldBits) - 1;
constexpr int kFieldsPerWord = 3;
constexpr int kCountWords = (kMaxRegisterSteps + kFieldsPerWord - 1) / kFieldsPerWord;

// One 10-bit count per step, three per word.
struct StepFields {
  unsigned words[kCountWords];

  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int i = 0; i < kCountWords; ++i) words[i] = 0;
  }
  __device__ __forceinline__ void put(int step, unsigned count) {
    words[step / kFieldsPerWord] |= count << (kFieldBits * (step % kFieldsPerWord));
  }
  __device__ __forceinline__ unsigned get(int step) const {
    return (words[step / kFieldsPerWord] >> (kFieldBits * (step % kFieldsPerWord))) & kFieldMask;
  }
  // Inclusive scan over the lanes of the first `used` words (warp-uniform). No field carries into the
  // next: each partial sum is at most 32 x 16 = 512 < 2^10.
  __device__ __forceinline__ void inclusive_scan(int used, int lane) {
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
#pragma unroll
      for (int i = 0; i < kCountWords; ++i) {
        if (i < used) {
          const unsigned other = __shfl_up_sync(0xffffffffu, words[i], offset);
          if (lane >= offset) words[i] += other;
        }
      }
    }
  }
  // Lane 31's words (the warp's totals per step), in every lane.
  __device__ __forceinline__ StepFields warp_totals(int used) const {
    StepFields t;
#pragma unroll
    for (int i = 0; i < kCountWords; ++i) t.words[i] = i < used ? __shfl_sync(0xffffffffu, words[i], 31) : 0u;
    return t;
  }
  __device__ __forceinline__ int sum(int steps) const {
    int total = 0;
#pragma unroll
    for (int s = 0; s < kMaxRegisterSteps; ++s) total += s < steps ? static_cast<int>(get(s)) : 0;
    return total;
  }
};

template <int kGroup, bool kSplitTies>
struct RegisterEntries {
  unsigned masks[kMaxRegisterSteps];  // bits 0-15: entries (better ones when kSplitTies); 16-31: ties at T
  StepFields better_before, ties_before;  // exclusive scans over the lanes, per step
  StepFields better_total, ties_total;    // the warp's counts per step
  int steps, used;

  // Reads the warp's `steps` x 512 positions from `first_vector` once. Entries: distances below
  // `limit_bytes`; with kSplitTies also the ties at `threshold_bytes`, counted apart.
  __device__ __forceinline__ void count(const uint4* vectors, int first_vector, int warp_steps, unsigned limit_bytes,
                                        unsigned threshold_bytes) {
    const int lane = threadIdx.x & 31;
    steps = warp_steps;
    used = (steps + kFieldsPerWord - 1) / kFieldsPerWord;
    StepFields better_own, ties_own;
    better_own.clear();
    ties_own.clear();
#pragma unroll
    for (int s = 0; s < kMaxRegisterSteps; ++s) {
      masks[s] = 0;
      if (s < steps) {
        unsigned better, ties;
        vector_entry_bits<kGroup, kSplitTies>(vectors[first_vector + s * 32 + lane], limit_bytes, threshold_bytes,
                                              better, ties);
        masks[s] = better | ties << 16;
        better_own.put(s, __popc(better));
        if constexpr (kSplitTies) ties_own.put(s, __popc(ties));
      }
    }
    better_before = better_own;
    better_before.inclusive_scan(used, lane);
    better_total = better_before.warp_totals(used);
    if constexpr (kSplitTies) {
      ties_before = ties_own;
      ties_before.inclusive_scan(used, lane);
      ties_total = ties_before.warp_totals(used);
    } else {
      ties_total.clear();
    }
#pragma unroll
    for (int i = 0; i < kCountWords; ++i) {  // inclusive -> exclusive, field by field (no borrows)
      better_before.words[i] -= better_own.words[i];
      if constexpr (kSplitTies) ties_before.words[i] -= ties_own.words[i];
    }
  }

  __device__ __forceinline__ int warp_better() const { return better_total.sum(steps); }
  __device__ __forceinline__ int warp_ties() const { return kSplitTies ? ties_total.sum(steps) : 0; }

  // Writes the entries in position order, the warp's better entries from out[better_base] and its
  // ties numbered from ties_base, as write_warp_entries does.
  __device__ __forceinline__ void write(int first_vector, int first_position, int chunk_skip, int better_base,
                                        int ties_base, int32_t* out) const {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int s = 0; s < kMaxRegisterSteps; ++s) {
      if (s < steps) {
        const int position = first_position + (first_vector + s * 32 + lane) * 16;
        const unsigned better = masks[s] & 0xffffu;
        const int before = static_cast<int>(better_before.get(s));
        if constexpr (!kSplitTies) {
          write_positions(better, position, out + better_base + before);
        } else {  // the boundary chunk: as in write_warp_entries
          const int tie_rank = ties_base + static_cast<int>(ties_before.get(s));
          write_positions(better | kept_ties(masks[s] >> 16, tie_rank, chunk_skip), position,
                          out + better_base + before + max(tie_rank - chunk_skip, 0));
        }
        better_base += static_cast<int>(better_total.get(s));
        if constexpr (kSplitTies) ties_base += static_cast<int>(ties_total.get(s));
      }
    }
  }
};

// Publishes each warp's entry counts (better entries, ties) in shared memory and returns those of the
// warps before it: the warp's offsets within the chunk. Call from every thread.
__device__ __forceinline__ int2 warp_offsets_in_chunk(int better, int ties, int32_t* warp_better, int32_t* warp_ties) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    warp_better[warp] = better;
    warp_ties[warp] = ties;
  }
  __syncthreads();
  int2 before = make_int2(0, 0);
#pragma unroll
  for (int v = 0; v < kWarps; ++v) {
    before.x += v < warp ? warp_better[v] : 0;
    before.y += v < warp ? warp_ties[v] : 0;
  }
  return before;
}

// Phase 2 after the threshold, register path (see RegisterEntries). Call from every thread.
template <int kGroup, bool kSplitTies>
__device__ __forceinline__ void count_and_write_from_registers(const uint4* vectors, int first_vector, int steps,
                                                               int first_position, unsigned limit_bytes,
                                                               unsigned threshold_bytes, int chunk_skip, int32_t* out,
                                                               int32_t* warp_better, int32_t* warp_ties) {
  RegisterEntries<kGroup, kSplitTies> entries;
  entries.count(vectors, first_vector, steps, limit_bytes, threshold_bytes);
  const int2 before = warp_offsets_in_chunk(entries.warp_better(), entries.warp_ties(), warp_better, warp_ties);
  entries.write(first_vector, first_position, chunk_skip, before.x, before.y, out);
}

// Five resident blocks per multiprocessor (48 registers, no spills; 64 without the bound): a static
// cache a few slots past a multiple of the chunk (n + decode steps) adds a nearly empty chunk per
// row, and with four blocks per multiprocessor that fifth block did not fit at the preferred chunk
// size (see kPreferredBlocksPerSm).
constexpr int kMinResidentBlocks = 5;

// kGroup: query heads per selection head (the distance of a position sums kGroup popcounts).
// Dynamic shared memory: `chunk` distance bytes.
template <int kGroup>
__global__ void __launch_bounds__(kThreads, kMinResidentBlocks)
    resident_select_kernel(SelectionParams p, HammingSource src, int chunk, int2 offset, int32_t* histograms) {
  using Bytes = DistanceBytes<kGroup>;
  using Counters = PhaseOneCounters<kGroup>;
  constexpr int kBins = Counters::kBins;    // possible distances
  constexpr int kParts = kThreads / kBins;  // threads summing one bin's chunk histograms
  static_assert(kBins <= kThreads, "one bin per thread");
  extern __shared__ uint4 dynamic_smem[];
  unsigned* distance_words = reinterpret_cast<unsigned*>(dynamic_smem);  // chunk / 4 words
  __shared__ uint32_t counter_words[Counters::kWords];
  __shared__ int32_t chunk_histogram[kBins];
  __shared__ int32_t warp_better[kWarps], warp_ties[kWarps];
  __shared__ int32_t row_threshold;
  __shared__ int64_t row_better, row_better_before, row_ties_before, row_ties;
  const Counters counters{counter_words};
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  const BlockCoordinates at = block_coordinates(p, chunk, offset);  // offset: (head row, batch) of the slice
  const int chunks = static_cast<int>(gridDim.x);
  // The first batch of loads goes out before the row's window (global reads of lengths, starts and
  // budgets) is known: whole groups of four inside the signatures are always safe to read (the
  // launch guarantees keys >= 4; the partial group at the end is corrected by mask_chunk_edges).
  const int keys4 = static_cast<int>(p.keys & ~int64_t(3));
  ChunkLoads loads;
  loads.key_row = src.k + at.b * src.ks0 + ((int64_t(at.s) * kGroup) / src.per_key) * src.ks1;
  loads.base = at.base;
  loads.last_batch = chunk / (kThreads * 4 * kLoadBatch) - 1;  // 4096 positions per batch
  loads.last_position = min(at.base + chunk, keys4) - 4;
  int4 first_batch[kLoadBatch];
  // Launched programmatically (see launch_for_group), this block may be placed while the kernel
  // before it still runs: nothing global is read before that grid is done.
  wait_for_prerequisite_grids();
  loads.load(0, first_batch);

  const RowWindow w = p.window(at.b, at.l);
  const int64_t n = w.candidates(), m = w.heavy_budget;
  const int lo = static_cast<int>(max64(w.sink_end, at.base));
  const int hi = static_cast<int>(min64(w.local_begin, int64_t(at.base) + chunk));
  const bool scored = m > 0 && m < n && lo < hi;  // the same for every thread of the block

  // ---- phase 1: distances of the chunk into shared memory, and their histograms ----
  if (scored) {
    unsigned q[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      q[g] = static_cast<unsigned>(src.q[at.b * src.qs0 + (int64_t(at.s) * kGroup + g) * src.qs1 + at.l * src.qs2]);
    }
    for (int i = threadIdx.x; i < Counters::kWords; i += kThreads) counter_words[i] = 0;
    __syncthreads();
    score_chunk<kGroup>(q, loads, first_batch, distance_words, counters);
    __syncthreads();
    if (lo > at.base || hi < at.base + chunk) {  // block-uniform
      mask_chunk_edges<kGroup>(q, loads.key_row, at.base, chunk, lo, hi, keys4, distance_words, counters);
      __syncthreads();
    }
    if (threadIdx.x < kBins) {
      const int bin = threadIdx.x;
      int32_t total = 0;  // lanes visited in a rotated order: no bank conflicts
#pragma unroll 8
      for (int k = 0; k < 32; ++k) total += static_cast<int32_t>(counter_words[bin * 32 + ((k + bin) & 31)]);
      chunk_histogram[bin] = total;
      histograms[(int64_t(at.row) * chunks + at.chunk_index) * kBins + bin] = total;
    }
  }

  cg::this_grid().sync();  // every chunk histogram is written (the barrier orders memory too)
  // The attention after this kernel (launched programmatically) may now be scheduled: its blocks
  // take the multiprocessors as this grid's blocks leave, and wait for all of its writes.
  allow_dependent_launch();

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
  // four chunks' loads in flight at a time; warp 0 then adds the parts and finds the threshold by
  // one warp scan. (A block-wide scan here cost three more barriers.) The counters are free: the
  // grid barrier ordered phase 1's last reads of them before these writes.
  const int c_first = static_cast<int>(w.sink_end / chunk), c_last = static_cast<int>((w.local_begin - 1) / chunk);
  const int bin = threadIdx.x % kBins, part = threadIdx.x / kBins;
  int32_t* part_sums = reinterpret_cast<int32_t*>(counter_words);  // [part][bin][total, before]
  static_assert(Counters::kWords >= kParts * kBins * 2, "the part sums fit the counters");
  if (part < kParts) {
    const int32_t* h = histograms + int64_t(at.row) * chunks * kBins + bin;
    int32_t total = 0, before = 0;
    int c = c_first + part;
    for (; c + 3 * kParts <= c_last; c += 4 * kParts) {
      int32_t x[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) x[u] = __ldcg(h + int64_t(c + u * kParts) * kBins);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        total += x[u];
        before += c + u * kParts < at.chunk_index ? x[u] : 0;
      }
    }
    for (; c <= c_last; c += kParts) {
      const int32_t x = __ldcg(h + int64_t(c) * kBins);
      total += x;
      before += c < at.chunk_index ? x : 0;
    }
    part_sums[(part * kBins + bin) * 2] = total;
    part_sums[(part * kBins + bin) * 2 + 1] = before;
  }
  __syncthreads();
  if (warp == 0) {
    // Lane l owns bins l * kBinsPerLane, ... (contiguous, so one scan of the lanes' sums orders
    // them). Both counts travel in one int64 (each < 2^31: the halves never carry into each other).
    constexpr int kBinsPerLane = (kBins + 31) / 32;
    constexpr int64_t kLow = 0xffffffffll;
    int64_t counts[kBinsPerLane], lane_sum = 0;
#pragma unroll
    for (int j = 0; j < kBinsPerLane; ++j) {
      const int b = lane * kBinsPerLane + j;
      int64_t total = 0, before = 0;
      if (b < kBins) {
#pragma unroll
        for (int k = 0; k < kParts; ++k) {
          total += part_sums[(k * kBins + b) * 2];
          before += part_sums[(k * kBins + b) * 2 + 1];
        }
      }
      counts[j] = total | (before << 32);
      lane_sum += counts[j];
    }
    int64_t inclusive = lane_sum;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int64_t other = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += other;
    }
    int64_t exclusive = inclusive - lane_sum;  // counts of the distances below this lane's first bin
#pragma unroll
    for (int j = 0; j < kBinsPerLane; ++j) {
      const int b = lane * kBinsPerLane + j;
      const int64_t below = exclusive & kLow, total = counts[j] & kLow;
      if (b < kBins && below < m && below + total >= m) {  // exactly one bin: 0 < m < n
        row_threshold = b;
        row_better = below;
        row_better_before = exclusive >> 32;
        row_ties_before = counts[j] >> 32;
        row_ties = total;
      }
      exclusive += counts[j];
    }
  }
  __syncthreads();
  const int threshold = row_threshold;
  const int64_t skip = row_ties - (m - row_better);  // the earliest ties at T are dropped
  const int64_t ties_before = row_ties_before;
  int32_t* out = row_out + row_better_before + max64(ties_before - skip, 0);

  // Ties at T are dropped earliest first, so every chunk but (at most) the one where the dropping
  // stops either keeps all its ties or none: there, an entry is a distance below a limit (T + 1 or
  // T); only that boundary chunk counts better entries and ties apart.
  const int chunk_ties = chunk_histogram[threshold];
  const bool split = !(ties_before >= skip || ties_before + chunk_ties <= skip);  // block-uniform
  const int limit = !split && ties_before >= skip ? threshold + 1 : threshold;  // split: better entries only
  const int vectors_per_warp = chunk / (16 * kWarps), steps = vectors_per_warp / 32;
  const int first_vector = warp * vectors_per_warp;
  const uint4* vectors = dynamic_smem;

  const unsigned limit_bytes = unsigned(limit) * 0x01010101u, threshold_bytes = unsigned(threshold) * 0x01010101u;
  if (steps <= kMaxRegisterSteps) {  // block-uniform
    if (split) {
      count_and_write_from_registers<kGroup, true>(vectors, first_vector, steps, at.base, limit_bytes, threshold_bytes,
                                                   static_cast<int>(skip - ties_before), out, warp_better, warp_ties);
    } else {
      count_and_write_from_registers<kGroup, false>(vectors, first_vector, steps, at.base, limit_bytes,
                                                    threshold_bytes, 0, out, warp_better, warp_ties);
    }
    return;
  }

  // Larger chunks (64K positions): each warp's entries (better and ties), then their offsets
  // within the chunk, then a second pass that writes them.
  unsigned better = 0, ties = 0;
  for (int step = 0; step < steps; ++step) {
    const uint4 d = vectors[first_vector + step * 32 + lane];
    const unsigned words[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      better += __popc(Bytes::less(words[k], limit_bytes));
      if (split) ties += __popc(bytes_equal(words[k], threshold_bytes));
    }
  }
  const int warp_better_count = static_cast<int>(__reduce_add_sync(0xffffffffu, better));
  const int warp_tie_count = split ? static_cast<int>(__reduce_add_sync(0xffffffffu, ties)) : 0;
  const int2 before = warp_offsets_in_chunk(warp_better_count, warp_tie_count, warp_better, warp_ties);
  const int better_base = before.x, ties_base = before.y;
  if (!split) {
    write_warp_entries<kGroup, false>(vectors, first_vector, steps, at.base, limit_bytes, threshold_bytes, 0,
                                      better_base, 0, out);
  } else {
    write_warp_entries<kGroup, true>(vectors, first_vector, steps, at.base, limit_bytes, threshold_bytes,
                                     static_cast<int>(skip - ties_before), better_base, ties_base, out);
  }
}

// Chunk sizes: 4096 positions (one 512-position batch per warp, and one 512-position phase-2
// step), or multiples of 8192 (score_chunk alternates two batches). Capacity is set by shared
// memory (a byte per position): about 25M positions on an H200.
constexpr int kChunkSizes[] = {4096, 8192, 16384, 32768, 65536};
// Preferred grid: the smallest chunks that make at most this many working blocks per
// multiprocessor (as the chunked path, whose kernels were measured latency-bound with fewer);
// more, smaller blocks only add per-block work (prologue, histogram sums, barrier arrivals).
// A row's last chunk counts by the share of its positions: a model's static cache holds n +
// decode-step slots (131,200 for n = 128K), and counting that nearly empty fifth 32K chunk per row
// as a whole block pushed the grid to 64K chunks -- about 2 working blocks per multiprocessor
// instead of 4 -- which made the selection 28% slower at B = 4 and 20% at B = 1 (H200, per-sequence
// lengths: 38.5 -> 49-51 us and 14.8 -> 17.9 us at 128K).
constexpr int kPreferredBlocksPerSm = 4;

// How one launch of a grid of `slice_rows` rows is cut: the chunk size (index into kChunkSizes), or
// -1 when no chunk size makes every block resident.
struct ChunkChoice {
  int index = -1;
  int64_t max_rows = 0;  // the most rows one resident launch can serve, at any allowed chunk size
};

template <int kGroup>
ChunkChoice choose_chunk(const SelectionParams& p, int64_t slice_rows) {
  const auto kernel = resident_select_kernel<kGroup>;
  const int64_t sms = multiprocessor_count();
  // Resident blocks per multiprocessor for each chunk size: fixed by the kernel and the
  // architecture, so asked from the driver once (-1: not yet).
  static std::atomic<int> resident_per_sm[] = {-1, -1, -1, -1, -1};
  static_assert(std::size(resident_per_sm) == std::size(kChunkSizes), "one count per chunk size");
  // Tests only (environment_overrides.h): HASHATTENTION_SELECTION_CHUNK considers that chunk size
  // alone (a grid that is not resident is then cut into slices, or a row that does not fit takes
  // the chunked path); HASHATTENTION_SELECTION_RESIDENT_BLOCKS caps the resident blocks, so that
  // small problems are cut into grid slices as large ones are.
  const int forced_chunk = environment::selection_chunk_size(kChunkSizes);
  const int64_t forced_blocks = environment::selection_resident_blocks().value_or(0);
  ChunkChoice choice;
  bool preferred = false;
  for (size_t i = 0; i < std::size(kChunkSizes); ++i) {
    if (forced_chunk != 0 && forced_chunk != kChunkSizes[i]) continue;
    int per_sm = resident_per_sm[i].load();
    if (per_sm < 0) {
      allow_shared_memory(kernel, kChunkSizes[i]);
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, kChunkSizes[i]));
      resident_per_sm[i] = per_sm;
    }
    int64_t capacity = int64_t(per_sm) * sms;
    if (forced_blocks > 0) capacity = std::min(capacity, forced_blocks);
    const int64_t chunks = std::max<int64_t>(1, ceil_div(p.keys, kChunkSizes[i]));
    choice.max_rows = std::max(choice.max_rows, capacity / chunks);
    if (preferred || slice_rows * chunks > capacity) continue;  // not resident: the barrier would deadlock
    if (choice.index < 0) choice.index = static_cast<int>(i);  // the smallest resident chunk, unless one below is preferred
    const double working_blocks = double(slice_rows) * double(p.keys) / double(kChunkSizes[i]);
    if (working_blocks <= double(kPreferredBlocksPerSm * sms)) {
      choice.index = static_cast<int>(i);
      preferred = true;
    }
  }
  return choice;
}

// A problem too large for one resident grid (e.g. B = 8 x 32 heads x 128K positions, 33.5M, on an
// H200) is cut into grid slices launched one after the other: whole batches per slice when a
// batch fits, else slices of one batch's head rows; slices as equal as possible. Two launches of
// the one-launch kernel still read each signature once, where the chunked two-kernel path read
// them twice (H200, B = 8 / 128K / 32x per query head: 150 us on the chunked path).
template <int kGroup>
bool launch_for_group(const SelectionParams& p, const HammingSource& src, int64_t row_count, const at::Tensor& like) {
  constexpr int kBins = PhaseOneCounters<kGroup>::kBins;
  const int64_t head_rows = p.heads * p.rows, batches = row_count / head_rows;
  ChunkChoice choice = choose_chunk<kGroup>(p, row_count);
  int64_t slice_batches = batches, slice_head_rows = head_rows;
  if (choice.index < 0) {
    if (choice.max_rows == 0) return false;  // not even one row fits: the chunked path
    if (head_rows <= choice.max_rows) {
      const int64_t launches = ceil_div(batches, choice.max_rows / head_rows);
      slice_batches = ceil_div(batches, launches);
    } else {
      slice_batches = 1;
      slice_head_rows = ceil_div(head_rows, ceil_div(head_rows, choice.max_rows));
    }
    choice = choose_chunk<kGroup>(p, slice_batches * slice_head_rows);
    TORCH_CHECK(choice.index >= 0, "hamming_topk: internal error, no resident grid for a slice of ",
                slice_batches * slice_head_rows, " rows");
  }
  const auto kernel = resident_select_kernel<kGroup>;
  int chunk = kChunkSizes[choice.index];
  const int64_t chunks = std::max<int64_t>(1, ceil_div(p.keys, chunk));
  allow_shared_memory(kernel, chunk);
  // Chunk histograms of every row (each slice writes its own rows'): sized from shapes only.
  at::Tensor workspace = at::empty({row_count * chunks * kBins}, like.options().dtype(at::kInt));
  int32_t* histograms = workspace.data_ptr<int32_t>();
  SelectionParams params = p;
  HammingSource source = src;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const bool programmatic = programmatic_launch_allowed(reinterpret_cast<const void*>(kernel));
  for (int64_t z = 0; z < batches; z += slice_batches) {
    for (int64_t y = 0; y < head_rows; y += slice_head_rows) {
      int2 offset = make_int2(static_cast<int>(y), static_cast<int>(z));
      void* args[] = {&params, &source, &chunk, &offset, &histograms};
      const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(std::min(slice_head_rows, head_rows - y)),
                      static_cast<unsigned>(std::min(slice_batches, batches - z)));
      // Cooperative (every block resident: the grid barrier cannot deadlock) and, where allowed,
      // programmatic: the blocks are placed while the kernel before finishes, and wait for it
      // before their first global read.
      KernelLaunch launch(grid, dim3(kThreads), static_cast<size_t>(chunk), stream);
      launch.cooperative();
      if (programmatic) launch.programmatic();
      C10_CUDA_CHECK(cudaLaunchKernelExC(&launch.config, reinterpret_cast<const void*>(kernel), args));
    }
  }
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
  if (environment::selection_chunked_only()) return false;
  // p.keys >= 4: phase 1 reads whole 16-byte groups of the signatures (see ChunkLoads).
  if (src.words != 1 || !src.vector_keys || !src.shared_key_head || p.keys < 4) return false;
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
