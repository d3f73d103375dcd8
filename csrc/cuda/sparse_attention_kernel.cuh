// Split-K (flash-decoding) sparse attention over index lists, for one head dim, dtype and
// maximum number of query heads per block (kMaxHeads).
//
// Work decomposition: a block serves one "unit" -- up to kMaxHeads consecutive query heads of
// one (sequence, query row) that share both the index list (selection head) and the KV head --
// and one split of that list. It therefore reads each selected K/V row once for all the query
// heads of the unit (group-shared mode: the whole GQA group). The lanes of a warp load 32 list
// entries at once (one coalesced load), resolve them to row addresses (HF layout with any
// strides, or paged through the block table), then a row is read by D / 8 lanes with 16-byte
// loads, several rows in flight per lane. Softmax is online in float32 (base 2, the scale folded
// into q). Partial results of the splits are merged by log-sum-exp in the same kernel, in one of
// two ways. When a unit's splits form one thread-block cluster (sm_90, at most 16 splits; the
// host picks it when the clusters fit the device at once), each block leaves its partial state in
// its shared memory and, after a cluster barrier, the first block reads its peers' states through
// distributed shared memory and writes out and lse: no workspace, no counter to zero (one graph
// node less) and no round trip through L2. Otherwise the last block of a unit to finish (an
// atomic counter per unit, zeroed by the host op) combines the states the splits wrote to global
// memory.
//
// Two main loops. One head per block (per-query-head selection): each warp takes 32-entry tiles
// in turn and loads a step's rows right before it consumes them; five resident blocks per
// multiprocessor (96 registers) keep enough rows in flight. Several heads per block (group-shared
// selection, kPipelined): the per-head registers allow 2-3 resident blocks, so each warp loads its
// next step while it consumes the current one, and steps (not tiles) are dealt to the warps in
// turn, so that short splits keep every warp busy. H200, bf16, D = 128, 32x, the attention alone
// with the one-wave split rule of sparse_attention.cu, plain -> pipelined loop: group-shared
// B = 1 / 512K 44.5 -> 39.4 us, B = 4 / 128K 43.4 -> 39.1 us, B = 1 / 32K 15.2 -> 11.7 us (with
// 32-row splits). For one head per block the pipelined loop was slower (128 registers, four
// resident blocks) and is not used there.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "int_math.cuh"
#include "programmatic_launch.cuh"

namespace hashattention {
namespace cuda {

constexpr int kAttentionThreads = 128;
constexpr int kAttentionWarps = kAttentionThreads / 32;
// Splits of one list: the merge keeps one weight per (split, head) in the warp-state buffer,
// which holds kAttentionWarps * (D + 2) floats per head, at least 4 * 66 = 264.
constexpr int kMaxSplits = 256;
constexpr int kMaxClusterSplits = 16;  // the largest (non-portable) cluster of sm_90
constexpr int kMinRowsPerSplit = 128;           // plain loop: at least one 32-entry tile per warp
constexpr int kMinRowsPerSplitPipelined = 32;  // pipelined loop: steps are dealt to the warps in turn

struct AttentionParams {
  const void* query;
  int64_t q_s0, q_s1, q_s2;
  const void* key;
  const void* value;
  int64_t k_s0, k_s1, k_s2, v_s0, v_s1, v_s2;  // HF: (batch, head, position); paged: (page, slot, head)
  const int32_t* block_table;                  // nullptr for the HF layout
  int64_t bt_s0, bt_s1, page_size, num_pages;
  int64_t keys;  // valid positions are [0, keys)
  const int32_t* indices;
  int64_t i_s0, i_s1, i_s2;
  const int32_t* counts;  // nullptr: every entry is used
  int64_t c_s0, c_s1, c_s2;
  int64_t width;
  void* out;   // (B, Hq, L, D) contiguous, query dtype
  float* lse;  // (B, Hq, L)
  float scale_log2;
  int query_heads, rows;
  int heads_per_selection, heads_per_kv;
  int unit_heads;     // query heads sharing one list and one KV head: gcd of the two above
  int subunits;       // ceil(unit_heads / kMaxHeads)
  int units_per_row;  // (query_heads / unit_heads) * subunits
  int splits, rows_per_split;
  int vector_loads;  // 1 when every K/V row start is 16-byte aligned
  float* partial_acc;      // (units, splits, kMaxHeads, D): unnormalised outputs of each split
  float* partial_max_sum;  // (units, splits, kMaxHeads, 2): running max (base 2) and sum
  int* counters;           // (units,), zero on entry and on exit; unused when cluster_merge
  int cluster_merge;       // 1: the splits of a unit are one cluster (grid.y == cluster size == splits)
};

template <typename T>
struct Elements;  // 8 consecutive elements of a row: load and convert to float

template <>
struct Elements<float> {
  uint4 raw[2];
  __device__ __forceinline__ void load(const float* p, bool vector) {
    if (vector) {
      raw[0] = __ldg(reinterpret_cast<const uint4*>(p));
      raw[1] = __ldg(reinterpret_cast<const uint4*>(p) + 1);
    } else {
      uint32_t* r = reinterpret_cast<uint32_t*>(raw);
#pragma unroll
      for (int e = 0; e < 8; ++e) r[e] = __float_as_uint(__ldg(p + e));
    }
  }
  __device__ __forceinline__ void clear() { raw[0] = raw[1] = make_uint4(0, 0, 0, 0); }
  __device__ __forceinline__ void to_float(float (&f)[8]) const {
    const float* r = reinterpret_cast<const float*>(raw);
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = r[e];
  }
};

template <typename T, typename T2>
struct PackedElements {
  uint4 raw;
  __device__ __forceinline__ void load(const T* p, bool vector) {
    if (vector) {
      raw = __ldg(reinterpret_cast<const uint4*>(p));
    } else {
      const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
      unsigned short* r = reinterpret_cast<unsigned short*>(&raw);
#pragma unroll
      for (int e = 0; e < 8; ++e) r[e] = __ldg(s + e);
    }
  }
  __device__ __forceinline__ void clear() { raw = make_uint4(0, 0, 0, 0); }
};

template <>
struct Elements<c10::Half> : PackedElements<c10::Half, __half2> {
  __device__ __forceinline__ void to_float(float (&f)[8]) const {
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 v = __half22float2(h[e]);
      f[2 * e] = v.x;
      f[2 * e + 1] = v.y;
    }
  }
};

template <>
struct Elements<c10::BFloat16> : PackedElements<c10::BFloat16, __nv_bfloat162> {
  __device__ __forceinline__ void to_float(float (&f)[8]) const {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 v = __bfloat1622float2(h[e]);
      f[2 * e] = v.x;
      f[2 * e + 1] = v.y;
    }
  }
};

// Softmax states (running max in base 2, sum of weights, weighted values) combine with the
// arithmetic below, which gives what dense attention (SDPA's math backend, torch.softmax and
// torch.logsumexp) gives for non-finite logits, without a branch in the main loop:
// * a NaN logit makes the max NaN (max_keeping_nan), and with it every weight, sum and output;
// * a +inf logit gets the weight exp2(inf - inf) = NaN: out is NaN, lse +inf (natural_lse);
// * when every logit so far is -inf (nothing selected, or infinite inputs) the exponents are
//   shifted by 0 instead of the max (softmax_shift), so every weight is exp2(-inf) = 0: out = 0,
//   lse = -inf, as SDPA gives a row whose logits are all -inf;
// * a value row enters as weight * v even at weight 0, so an infinite or NaN value shows as in
//   dense softmax(...) @ V.
// fmaxf returns the other operand for a NaN: a NaN logit would vanish from a row whose other
// logits are -inf.
__device__ __forceinline__ float max_keeping_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float m;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
  return m;
#else
  return a != a || a > b ? a : b;
#endif
}

// The exponent shift of a state whose max is `m`: exp2(x - softmax_shift(m)) is the weight of
// logit x (or the rescale of a state with max x).
__device__ __forceinline__ float softmax_shift(float m) { return m == -INFINITY ? 0.0f : m; }

// 1 / sum, and 0 for a state without weight (out = 0, or NaN where a value was not finite).
__device__ __forceinline__ float inverse_sum(float sum) { return sum == 0.0f ? 0.0f : 1.0f / sum; }

// The natural-log log-sum-exp of a state with max `m` (base 2) and weight sum `sum`.
__device__ __forceinline__ float natural_lse(float m, float sum) {
  return m == INFINITY ? INFINITY : (m + log2f(sum)) * 0.69314718055994531f;
}

// The cluster merge: every split of the unit (one block each, the whole cluster) has left its
// state in `state` (per head: D unnormalised output columns, then the running max in base 2 and
// the sum, in a row of D + 4 floats). After a cluster barrier the first block combines them by
// log-sum-exp, reading its peers' shared memory, and writes out and lse of the unit's `heads`
// heads, whose first output row is `first_row` (rows of consecutive heads are `head_rows` apart).
// Every remote read of a round is independent of the others, so each round costs one
// distributed-shared-memory latency: the (max, sum) pairs, one per thread, then each thread's
// column quads over all splits (reading them split after split, a dependent chain, merged slower
// than the counters' path through L2). `scratch` is the first block's own
// shared memory, free by then (at least 34 floats per head). The second barrier keeps every block,
// and so its shared memory, alive until the first block has read it.
template <typename T, int D, int kMaxHeads>
__device__ __forceinline__ void merge_cluster_splits(float (&state)[kMaxHeads][D + 4], float* scratch, int splits,
                                                     int heads, T* out, int64_t first_row, int64_t head_rows,
                                                     float* lse) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // release / acquire: the peers' states are visible
  if (cluster.block_rank() == 0) {
    float* own = &state[0][0];
    float* split_max = scratch;                                // [kMaxClusterSplits][kMaxHeads]
    float* split_sum = split_max + kMaxClusterSplits * kMaxHeads;  // then the weights, in place
    float* head_sum = split_sum + kMaxClusterSplits * kMaxHeads;   // [kMaxHeads]
    float* head_max = head_sum + kMaxHeads;
    for (int i = threadIdx.x; i < splits * heads; i += kAttentionThreads) {
      const int sp = i / heads, h = i % heads;
      const float* peer = cluster.map_shared_rank(own, sp) + h * (D + 4);
      split_max[sp * kMaxHeads + h] = peer[D];
      split_sum[sp * kMaxHeads + h] = peer[D + 1];
    }
    __syncthreads();
    if (threadIdx.x < heads) {
      const int h = threadIdx.x;
      float m = -INFINITY;
      for (int sp = 0; sp < splits; ++sp) m = max_keeping_nan(m, split_max[sp * kMaxHeads + h]);
      const float shift = softmax_shift(m);
      float sum = 0.0f;
      for (int sp = 0; sp < splits; ++sp) {
        const float weight = exp2f(split_max[sp * kMaxHeads + h] - shift);
        sum = fmaf(split_sum[sp * kMaxHeads + h], weight, sum);
        split_sum[sp * kMaxHeads + h] = weight;
      }
      head_sum[h] = sum;
      head_max[h] = m;
    }
    __syncthreads();
    const float* weights = split_sum;
    for (int i = threadIdx.x; i < heads * (D / 4); i += kAttentionThreads) {
      const int h = i / (D / 4), d4 = i % (D / 4);
      float4 total = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int first = 0; first < kMaxClusterSplits; first += 8) {  // 8 loads in flight, then their sums
        if (first >= splits) break;
        float4 a[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const int sp = first + k;
          a[k] = sp < splits ? *reinterpret_cast<const float4*>(cluster.map_shared_rank(own, sp) + h * (D + 4) + d4 * 4)
                             : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float weight = first + k < splits ? weights[(first + k) * kMaxHeads + h] : 0.0f;
          total.x = fmaf(a[k].x, weight, total.x);
          total.y = fmaf(a[k].y, weight, total.y);
          total.z = fmaf(a[k].z, weight, total.z);
          total.w = fmaf(a[k].w, weight, total.w);
        }
      }
      const float sum = head_sum[h];
      const float inv = inverse_sum(sum);
      const int64_t row = first_row + h * head_rows;
      T* o = out + row * D + d4 * 4;
      o[0] = static_cast<T>(total.x * inv);
      o[1] = static_cast<T>(total.y * inv);
      o[2] = static_cast<T>(total.z * inv);
      o[3] = static_cast<T>(total.w * inv);
      if (d4 == 0) lse[row] = natural_lse(head_max[h], sum);
    }
  }
  cluster.sync();
#else
  __trap();  // the host launches clusters on sm_90 and later only
#endif
}

// Resident blocks per multiprocessor the compiler must allow (__launch_bounds__): one head per
// block needs 5 (at most 96 registers: at 100 the H200 held 4 blocks, and the B = 4 / 128K
// per-head attention ran 12% slower); several heads with 2-byte K/V in the pipelined loop 3 (168
// registers, no spills); otherwise no bound.
template <typename T, int kMaxHeads, bool kPipelined>
constexpr int kMinBlocks() {
  if (!kPipelined && kMaxHeads == 1) return sizeof(T) == 2 ? 5 : 1;
  return kPipelined && kMaxHeads <= 4 && sizeof(T) == 2 ? 3 : 1;
}

template <typename T, int D, int kMaxHeads, bool kPipelined>
__global__ void __launch_bounds__(kAttentionThreads, kMinBlocks<T, kMaxHeads, kPipelined>())
    sparse_attention_kernel(const AttentionParams p) {
  constexpr int kLanesPerRow = D / 8;
  constexpr int kRowsPerPass = 32 / kLanesPerRow;          // rows one warp instruction covers
  // Row passes loaded per step: fewer where registers are short (many heads, or two buffers).
  constexpr int kUnroll = kMaxHeads >= 8 || (kPipelined && kMaxHeads >= 4) ? 2 : 4;
  constexpr int kRowsPerStep = kRowsPerPass * kUnroll;  // divides 32
  static_assert(32 % kRowsPerStep == 0, "a step must divide a 32-entry tile");
  __shared__ float warp_state[kAttentionWarps][kMaxHeads][D + 2];
  // Cluster merge: this split's state per head (acc, then max and sum); rows of D + 4 floats keep
  // every head's columns 16-byte aligned for the merge's float4 reads.
  __shared__ alignas(16) float split_state[kMaxHeads][D + 4];
  __shared__ int is_last_block;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row_group = lane / kLanesPerRow;
  const int column = (lane % kLanesPerRow) * 8;

  // Which unit and split this block serves.
  const int64_t unit = blockIdx.x;
  const int within_row = static_cast<int>(unit % p.units_per_row);
  const int64_t sequence_row = unit / p.units_per_row;
  const int l = static_cast<int>(sequence_row % p.rows);
  const int64_t b = sequence_row / p.rows;
  const int head_group = within_row / p.subunits, sub = within_row % p.subunits;
  const int first_head = head_group * p.unit_heads + sub * kMaxHeads;
  const int heads = min(kMaxHeads, p.unit_heads - sub * kMaxHeads);
  const int s = first_head / p.heads_per_selection, kv = first_head / p.heads_per_kv;

  // Launched programmatically, this block may run before the selection has finished: nothing
  // global (counts, indices, even the query) is read before the grids ahead are done.
  wait_for_prerequisite_grids();
  int64_t count = p.width;
  if (p.counts != nullptr) {
    count = p.counts[b * p.c_s0 + s * p.c_s1 + l * p.c_s2];
    count = count < 0 ? 0 : (count > p.width ? p.width : count);
  }
  const int32_t* list = p.indices + b * p.i_s0 + s * p.i_s1 + l * p.i_s2;
  const int split = blockIdx.y;
  const int64_t j_begin = int64_t(split) * p.rows_per_split;
  const int64_t j_end = min64(count, j_begin + p.rows_per_split);

  const T* key = static_cast<const T*>(p.key);
  const T* value = static_cast<const T*>(p.value);
  const T* query = static_cast<const T*>(p.query);
  const bool vector = p.vector_loads != 0;

  float q[kMaxHeads][8];
#pragma unroll
  for (int h = 0; h < kMaxHeads; ++h) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      q[h][e] = h < heads ? static_cast<float>(query[b * p.q_s0 + (first_head + h) * p.q_s1 + l * p.q_s2 + column + e]) *
                                p.scale_log2
                          : 0.0f;
    }
  }
  float running_max[kMaxHeads], running_sum[kMaxHeads], acc[kMaxHeads][8];
#pragma unroll
  for (int h = 0; h < kMaxHeads; ++h) {
    running_max[h] = -INFINITY;
    running_sum[h] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[h][e] = 0.0f;
  }

  // Row offsets (in elements) of a list entry's position, or -1 for padding / out of range.
  auto resolve_position = [&](int64_t position, int64_t& k_off, int64_t& v_off) {
    k_off = -1;
    v_off = -1;
    if (position < 0 || position >= p.keys) return;
    if (p.block_table == nullptr) {
      k_off = b * p.k_s0 + kv * p.k_s1 + position * p.k_s2;
      v_off = b * p.v_s0 + kv * p.v_s1 + position * p.v_s2;
    } else {
      const int64_t page = p.block_table[b * p.bt_s0 + (position / p.page_size) * p.bt_s1];
      if (page < 0 || page >= p.num_pages) return;
      const int64_t slot = position % p.page_size;
      k_off = page * p.k_s0 + slot * p.k_s1 + kv * p.k_s2;
      v_off = page * p.v_s0 + slot * p.v_s1 + kv * p.v_s2;
    }
  };
  auto resolve = [&](int64_t j, int64_t& k_off, int64_t& v_off) {  // list entry j
    resolve_position(j < j_end ? int64_t(list[j]) : int64_t(-1), k_off, v_off);
  };

  // One step's K/V rows: pass u reads row first_row + u * kRowsPerPass + row_group of the warp's 32
  // resolved entries (row r's offsets are held by lane r); rows at or past row_limit, and padding,
  // are cleared and marked invalid.
  auto load_rows = [&](int64_t lane_k, int64_t lane_v, int first_row, int row_limit, Elements<T>(&k_rows)[kUnroll],
                       Elements<T>(&v_rows)[kUnroll], bool(&valid)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int r = first_row + u * kRowsPerPass + row_group;  // < 32
      const int64_t k_off = __shfl_sync(0xffffffffu, lane_k, r);
      const int64_t v_off = __shfl_sync(0xffffffffu, lane_v, r);
      valid[u] = r < row_limit && k_off >= 0;
      if (valid[u]) {
        k_rows[u].load(key + k_off + column, vector);
        v_rows[u].load(value + v_off + column, vector);
      } else {
        k_rows[u].clear();
        v_rows[u].clear();
      }
    }
  };

  // One step: the logits of kUnroll row passes for every head, then the online-softmax update.
  auto consume_step = [&](const Elements<T>(&k_rows)[kUnroll], const Elements<T>(&v_rows)[kUnroll],
                          const bool(&valid)[kUnroll]) {
    float logit[kUnroll][kMaxHeads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float kf[8];
      k_rows[u].to_float(kf);
#pragma unroll
      for (int h = 0; h < kMaxHeads; ++h) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) dot = fmaf(q[h][e], kf[e], dot);
#pragma unroll
        for (int offset = kLanesPerRow / 2; offset > 0; offset >>= 1) {
          dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        }
        logit[u][h] = valid[u] ? dot : -INFINITY;
      }
    }
    float vf[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v_rows[u].to_float(vf[u]);
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) {
      float step_max = logit[0][h];
#pragma unroll
      for (int u = 1; u < kUnroll; ++u) step_max = max_keeping_nan(step_max, logit[u][h]);
      const float new_max = max_keeping_nan(running_max[h], step_max);
      const float shift = softmax_shift(new_max);
      const float rescale = exp2f(running_max[h] - shift);
      running_sum[h] *= rescale;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[h][e] *= rescale;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float weight = exp2f(logit[u][h] - shift);
        running_sum[h] += weight;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[h][e] = fmaf(weight, vf[u][e], acc[h][e]);
      }
      running_max[h] = new_max;
    }
  };

  if constexpr (!kPipelined) {
    for (int64_t tile = j_begin + warp * 32; tile < j_end; tile += kAttentionWarps * 32) {
      int64_t lane_k, lane_v;
      resolve(tile + lane, lane_k, lane_v);
      const int tile_rows = static_cast<int>(min64(32, j_end - tile));
      for (int base = 0; base < tile_rows; base += kRowsPerStep) {
        Elements<T> k_rows[kUnroll], v_rows[kUnroll];
        bool valid[kUnroll];
        load_rows(lane_k, lane_v, base, tile_rows, k_rows, v_rows, valid);
        consume_step(k_rows, v_rows, valid);
      }
    }
  } else {
    // Steps of kRowsPerStep entries are dealt to the warps in turn (step i to warp i % warps), so
    // every warp works even on short splits, and each warp loads its next step before it
    // consumes the current one (two register buffers, no copies between them). A warp's "tile"
    // is 32 of its entries (kStepsPerTile of its steps): one coalesced index load, one entry per
    // lane, fetched one tile ahead.
    constexpr int kStepsPerTile = 32 / kRowsPerStep;
    const int64_t block_entries = j_end > j_begin ? j_end - j_begin : 0;
    const int block_steps = static_cast<int>(ceil_div(block_entries, kRowsPerStep));
    const int own_steps = block_steps > warp ? (block_steps - warp + kAttentionWarps - 1) / kAttentionWarps : 0;
    auto tile_position = [&](int tile) -> int64_t {  // this lane's list entry in the warp's tile, or -1
      const int own = tile * kStepsPerTile + lane / kRowsPerStep;
      const int64_t j = j_begin + (int64_t(own) * kAttentionWarps + warp) * kRowsPerStep + lane % kRowsPerStep;
      return own < own_steps && j < j_end ? int64_t(list[j]) : int64_t(-1);
    };
    struct StepRows {
      Elements<T> k[kUnroll], v[kUnroll];
      bool valid[kUnroll];
    };
    int64_t lane_k = -1, lane_v = -1, next_position = tile_position(0);
    auto load_step = [&](int own, StepRows& rows) {
      const int in_tile = own % kStepsPerTile;
      if (in_tile == 0) {  // warp-uniform: the tile's row offsets, then the next tile's entries
        resolve_position(next_position, lane_k, lane_v);
        next_position = tile_position(own / kStepsPerTile + 1);
      }
      load_rows(lane_k, lane_v, in_tile * kRowsPerStep, 32, rows.k, rows.v, rows.valid);
    };
    auto consume = [&](const StepRows& rows) { consume_step(rows.k, rows.v, rows.valid); };
    StepRows a, b;
    if (own_steps > 0) load_step(0, a);
    for (int own = 0; own < own_steps; own += 2) {
      const bool has_b = own + 1 < own_steps;
      if (has_b) load_step(own + 1, b);
      consume(a);
      if (!has_b) break;
      if (own + 2 < own_steps) load_step(own + 2, a);
      consume(b);
    }
  }

  // Merge the row groups of the warp (lanes that share a column range).
#pragma unroll
  for (int offset = kLanesPerRow; offset < 32; offset <<= 1) {
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) {
      const float other_max = __shfl_xor_sync(0xffffffffu, running_max[h], offset);
      const float other_sum = __shfl_xor_sync(0xffffffffu, running_sum[h], offset);
      const float new_max = max_keeping_nan(running_max[h], other_max);
      const float shift = softmax_shift(new_max);
      const float mine = exp2f(running_max[h] - shift);
      const float theirs = exp2f(other_max - shift);
      running_sum[h] = running_sum[h] * mine + other_sum * theirs;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float other = __shfl_xor_sync(0xffffffffu, acc[h][e], offset);
        acc[h][e] = acc[h][e] * mine + other * theirs;
      }
      running_max[h] = new_max;
    }
  }
  if (lane < kLanesPerRow) {
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) {
#pragma unroll
      for (int e = 0; e < 8; ++e) warp_state[warp][h][column + e] = acc[h][e];
      if (lane == 0) {
        warp_state[warp][h][D] = running_max[h];
        warp_state[warp][h][D + 1] = running_sum[h];
      }
    }
  }
  __syncthreads();

  // Merge the warps; write the result (one split) or this split's partial state.
  T* out = static_cast<T*>(p.out);
  const int64_t unit_split = unit * p.splits + split;
  for (int i = threadIdx.x; i < heads * (D + 1); i += kAttentionThreads) {
    const int h = i / (D + 1), d = i % (D + 1);  // d == D: the (max, sum) pair
    float block_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kAttentionWarps; ++w) block_max = max_keeping_nan(block_max, warp_state[w][h][D]);
    const float shift = softmax_shift(block_max);
    float total = 0.0f, sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kAttentionWarps; ++w) {
      const float weight = exp2f(warp_state[w][h][D] - shift);
      sum += warp_state[w][h][D + 1] * weight;
      if (d < D) total += warp_state[w][h][d] * weight;
    }
    const int64_t out_row = (b * p.query_heads + first_head + h) * p.rows + l;
    if (p.splits == 1) {
      if (d < D) {
        out[out_row * D + d] = static_cast<T>(total * inverse_sum(sum));
      } else {
        p.lse[out_row] = natural_lse(block_max, sum);
      }
    } else if (p.cluster_merge) {
      if (d < D) {
        split_state[h][d] = total;
      } else {
        split_state[h][D] = block_max;
        split_state[h][D + 1] = sum;
      }
    } else if (d < D) {
      p.partial_acc[(unit_split * kMaxHeads + h) * D + d] = total;
    } else {
      p.partial_max_sum[(unit_split * kMaxHeads + h) * 2] = block_max;
      p.partial_max_sum[(unit_split * kMaxHeads + h) * 2 + 1] = sum;
    }
  }
  if (p.splits == 1) return;
  if (p.cluster_merge) {
    merge_cluster_splits<T, D, kMaxHeads>(split_state, &warp_state[0][0][0], p.splits, heads, out,
                                          (b * p.query_heads + first_head) * p.rows + l, p.rows, p.lse);
    return;
  }

  // The last split of the unit to finish merges all partial states: first the weight of each
  // (split, head) in shared memory, then each thread sums 4 columns over the splits with
  // independent 16-byte loads (a serial chain of loads here would dominate the kernel).
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    is_last_block = atomicAdd(&p.counters[unit], 1) == p.splits - 1;
    // Every split has counted: the last one leaves the counter zero for the next launch (a
    // caller's workspace is reused without a memset).
    if (is_last_block) p.counters[unit] = 0;
  }
  __syncthreads();
  if (!is_last_block) return;
  __threadfence();
  float* split_weight = &warp_state[0][0][0];  // reused: (splits, kMaxHeads), splits <= kMaxSplits
  __shared__ float head_max[kMaxHeads], head_sum[kMaxHeads];
  const float* unit_max_sum = p.partial_max_sum + unit * p.splits * kMaxHeads * 2;
  for (int h = warp; h < heads; h += kAttentionWarps) {
    float m = -INFINITY;
    for (int sp = lane; sp < p.splits; sp += 32) {
      m = max_keeping_nan(m, __ldcg(unit_max_sum + (sp * kMaxHeads + h) * 2));
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) m = max_keeping_nan(m, __shfl_xor_sync(0xffffffffu, m, offset));
    const float shift = softmax_shift(m);
    float sum = 0.0f;
    for (int sp = lane; sp < p.splits; sp += 32) {
      const float weight = exp2f(__ldcg(unit_max_sum + (sp * kMaxHeads + h) * 2) - shift);
      split_weight[sp * kMaxHeads + h] = weight;
      sum += __ldcg(unit_max_sum + (sp * kMaxHeads + h) * 2 + 1) * weight;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) {
      head_max[h] = m;
      head_sum[h] = sum;
    }
  }
  __syncthreads();
  const float4* unit_acc = reinterpret_cast<const float4*>(p.partial_acc + unit * p.splits * kMaxHeads * D);
  for (int i = threadIdx.x; i < heads * (D / 4); i += kAttentionThreads) {
    const int h = i / (D / 4), d4 = i % (D / 4);
    float4 total = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
    for (int sp = 0; sp < p.splits; ++sp) {
      const float4 a = __ldcg(unit_acc + (sp * kMaxHeads + h) * (D / 4) + d4);
      const float weight = split_weight[sp * kMaxHeads + h];
      total.x = fmaf(a.x, weight, total.x);
      total.y = fmaf(a.y, weight, total.y);
      total.z = fmaf(a.z, weight, total.z);
      total.w = fmaf(a.w, weight, total.w);
    }
    const float sum = head_sum[h];
    const float inv = inverse_sum(sum);
    const int64_t out_row = (b * p.query_heads + first_head + h) * p.rows + l;
    T* o = out + out_row * D + d4 * 4;
    o[0] = static_cast<T>(total.x * inv);
    o[1] = static_cast<T>(total.y * inv);
    o[2] = static_cast<T>(total.z * inv);
    o[3] = static_cast<T>(total.w * inv);
    if (d4 == 0) p.lse[out_row] = natural_lse(head_max[h], sum);
  }
}

using AttentionKernel = void (*)(AttentionParams);

// The kernel for a head dim and a maximum number of heads per block (pipelined for more than
// one); nullptr for an unsupported combination. Instantiated per dtype in sparse_attention_<dtype>.cu (through
// attention_kernel<T> below), so that the dtypes compile in parallel.
template <typename T>
AttentionKernel select_attention_kernel(int head_dim, int max_heads) {
#define HA_KERNEL(D, H) \
  if (head_dim == D && max_heads == H) return sparse_attention_kernel<T, D, H, (H > 1)>;
  HA_KERNEL(64, 1) HA_KERNEL(64, 4) HA_KERNEL(64, 8)
  HA_KERNEL(128, 1) HA_KERNEL(128, 4) HA_KERNEL(128, 8)
  HA_KERNEL(256, 1) HA_KERNEL(256, 4) HA_KERNEL(256, 8)
#undef HA_KERNEL
  return nullptr;
}

template <typename T>
AttentionKernel attention_kernel(int head_dim, int max_heads);
template <>
AttentionKernel attention_kernel<float>(int, int);
template <>
AttentionKernel attention_kernel<c10::Half>(int, int);
template <>
AttentionKernel attention_kernel<c10::BFloat16>(int, int);

}  // namespace cuda
}  // namespace hashattention
