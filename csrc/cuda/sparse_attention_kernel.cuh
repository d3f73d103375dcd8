// Split-K (flash-decoding) sparse attention over index lists, for one head dim, dtype and
// maximum number of query heads per block (kMaxHeads).
//
// Work decomposition: a block serves one "unit" -- up to kMaxHeads consecutive query heads of
// one (sequence, query row) that share both the index list (selection head) and the KV head --
// and one split of that list. It therefore reads each selected K/V row once for all the query
// heads of the unit (group-shared mode: the whole GQA group). Inside a block, warps take tiles
// of 32 list entries; the 32 lanes of a warp load the 32 indices at once (one coalesced load),
// resolve them to row addresses (HF layout with any strides, or paged through the block table),
// then a row is read by D / 8 lanes with 16-byte loads, several rows in flight per lane.
// Softmax is online in float32 (base 2, the scale folded into q). Partial results of the
// splits are merged by log-sum-exp in the same kernel: the last block of a unit to finish
// (an atomic counter per unit, zeroed by the host op) combines them and writes out and lse.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "int_math.cuh"

namespace hashattention {
namespace cuda {

constexpr int kAttentionThreads = 128;
constexpr int kAttentionWarps = kAttentionThreads / 32;
// Splits of one list: the merge keeps one weight per (split, head) in the warp-state buffer,
// which holds kAttentionWarps * (D + 2) floats per head, at least 4 * 66 = 264.
constexpr int kMaxSplits = 256;
constexpr int kMinRowsPerSplit = 128;  // at least one 32-entry tile per warp

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
  int* counters;           // (units,), zero on entry
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

__device__ __forceinline__ float safe_exp2_diff(float a, float b) {  // exp2(a - b), 0 when a = -inf
  return a == -INFINITY ? 0.0f : exp2f(a - b);
}

template <typename T, int D, int kMaxHeads>
__global__ void __launch_bounds__(kAttentionThreads) sparse_attention_kernel(const AttentionParams p) {
  constexpr int kLanesPerRow = D / 8;
  constexpr int kRowsPerPass = 32 / kLanesPerRow;          // rows one warp instruction covers
  constexpr int kUnroll = kMaxHeads >= 8 ? 2 : 4;          // passes loaded before use
  constexpr int kRowsPerStep = kRowsPerPass * kUnroll;     // divides 32
  static_assert(32 % kRowsPerStep == 0, "a step must divide a 32-entry tile");
  __shared__ float warp_state[kAttentionWarps][kMaxHeads][D + 2];
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

  // Row offsets (in elements) of this lane's list entry, or -1 for padding / out of range.
  auto resolve = [&](int64_t j, int64_t& k_off, int64_t& v_off) {
    k_off = -1;
    v_off = -1;
    if (j >= j_end) return;
    const int64_t position = list[j];
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

  for (int64_t tile = j_begin + warp * 32; tile < j_end; tile += kAttentionWarps * 32) {
    int64_t lane_k, lane_v;
    resolve(tile + lane, lane_k, lane_v);
    const int tile_rows = static_cast<int>(min64(32, j_end - tile));
    for (int base = 0; base < tile_rows; base += kRowsPerStep) {
      Elements<T> k_rows[kUnroll], v_rows[kUnroll];
      bool valid[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int r = base + u * kRowsPerPass + row_group;  // < 32
        const int64_t k_off = __shfl_sync(0xffffffffu, lane_k, r);
        const int64_t v_off = __shfl_sync(0xffffffffu, lane_v, r);
        valid[u] = r < tile_rows && k_off >= 0;
        if (valid[u]) {
          k_rows[u].load(key + k_off + column, vector);
          v_rows[u].load(value + v_off + column, vector);
        } else {
          k_rows[u].clear();
          v_rows[u].clear();
        }
      }
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
        for (int u = 1; u < kUnroll; ++u) step_max = fmaxf(step_max, logit[u][h]);
        const float new_max = fmaxf(running_max[h], step_max);
        if (new_max == -INFINITY) continue;  // nothing valid yet for this row group
        const float rescale = safe_exp2_diff(running_max[h], new_max);
        running_sum[h] *= rescale;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[h][e] *= rescale;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const float weight = safe_exp2_diff(logit[u][h], new_max);
          running_sum[h] += weight;
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[h][e] = fmaf(weight, vf[u][e], acc[h][e]);
        }
        running_max[h] = new_max;
      }
    }
  }

  // Merge the row groups of the warp (lanes that share a column range).
#pragma unroll
  for (int offset = kLanesPerRow; offset < 32; offset <<= 1) {
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) {
      const float other_max = __shfl_xor_sync(0xffffffffu, running_max[h], offset);
      const float other_sum = __shfl_xor_sync(0xffffffffu, running_sum[h], offset);
      const float new_max = fmaxf(running_max[h], other_max);
      const float mine = new_max == -INFINITY ? 0.0f : safe_exp2_diff(running_max[h], new_max);
      const float theirs = new_max == -INFINITY ? 0.0f : safe_exp2_diff(other_max, new_max);
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
    for (int w = 0; w < kAttentionWarps; ++w) block_max = fmaxf(block_max, warp_state[w][h][D]);
    float total = 0.0f, sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kAttentionWarps; ++w) {
      const float weight = block_max == -INFINITY ? 0.0f : safe_exp2_diff(warp_state[w][h][D], block_max);
      sum += warp_state[w][h][D + 1] * weight;
      if (d < D) total += warp_state[w][h][d] * weight;
    }
    const int64_t out_row = (b * p.query_heads + first_head + h) * p.rows + l;
    if (p.splits == 1) {
      if (d < D) {
        out[out_row * D + d] = static_cast<T>(sum > 0.0f ? total / sum : 0.0f);
      } else {
        p.lse[out_row] = sum > 0.0f ? (block_max + log2f(sum)) * 0.69314718055994531f : -INFINITY;
      }
    } else if (d < D) {
      p.partial_acc[(unit_split * kMaxHeads + h) * D + d] = total;
    } else {
      p.partial_max_sum[(unit_split * kMaxHeads + h) * 2] = block_max;
      p.partial_max_sum[(unit_split * kMaxHeads + h) * 2 + 1] = sum;
    }
  }
  if (p.splits == 1) return;

  // The last split of the unit to finish merges all partial states: first the weight of each
  // (split, head) in shared memory, then each thread sums 4 columns over the splits with
  // independent 16-byte loads (a serial chain of loads here would dominate the kernel).
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last_block = atomicAdd(&p.counters[unit], 1) == p.splits - 1;
  __syncthreads();
  if (!is_last_block) return;
  __threadfence();
  float* split_weight = &warp_state[0][0][0];  // reused: (splits, kMaxHeads), splits <= kMaxSplits
  __shared__ float head_max[kMaxHeads], head_sum[kMaxHeads];
  const float* unit_max_sum = p.partial_max_sum + unit * p.splits * kMaxHeads * 2;
  for (int h = warp; h < heads; h += kAttentionWarps) {
    float m = -INFINITY;
    for (int sp = lane; sp < p.splits; sp += 32) m = fmaxf(m, __ldcg(unit_max_sum + (sp * kMaxHeads + h) * 2));
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    float sum = 0.0f;
    for (int sp = lane; sp < p.splits; sp += 32) {
      const float weight = m == -INFINITY ? 0.0f : safe_exp2_diff(__ldcg(unit_max_sum + (sp * kMaxHeads + h) * 2), m);
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
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int64_t out_row = (b * p.query_heads + first_head + h) * p.rows + l;
    T* o = out + out_row * D + d4 * 4;
    o[0] = static_cast<T>(total.x * inv);
    o[1] = static_cast<T>(total.y * inv);
    o[2] = static_cast<T>(total.z * inv);
    o[3] = static_cast<T>(total.w * inv);
    if (d4 == 0) p.lse[out_row] = sum > 0.0f ? (head_max[h] + log2f(sum)) * 0.69314718055994531f : -INFINITY;
  }
}

// Host-side launcher, instantiated per dtype in sparse_attention_<dtype>.cu.
template <typename T>
void launch_sparse_attention(const AttentionParams& params, int head_dim, int max_heads, dim3 grid,
                             cudaStream_t stream);
template <>
void launch_sparse_attention<float>(const AttentionParams&, int, int, dim3, cudaStream_t);
template <>
void launch_sparse_attention<c10::Half>(const AttentionParams&, int, int, dim3, cudaStream_t);
template <>
void launch_sparse_attention<c10::BFloat16>(const AttentionParams&, int, int, dim3, cudaStream_t);

}  // namespace cuda
}  // namespace hashattention
