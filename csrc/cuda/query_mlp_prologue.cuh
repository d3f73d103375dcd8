// encode_pair_and_select in one launch (opt-in, HASHATTENTION_FUSED_SELECTION=1; measured slower than
// two launches, benchmarks/results/ab_fused_selection_20261205_s37.md): the one-launch selection computes
// the signatures itself instead of reading the encoder's output. In its phase 0, chunk 0's block of each
// row runs the row's query MLP and chunk 1's block the new key's (stored into its cache slot); a grid
// barrier then publishes both. A block whose candidates include the new key's slot redoes that one
// distance after phase 1 (its loads may have seen the old word). The MLPs reach the selection through a
// host-side record that encode_pair_and_select's CUDA kernel (csrc/cuda/signatures.cu) leaves for its
// own hamming_topk call.
//
// Shape (otherwise encode_pair_and_select runs its two ops): bfloat16 rows of 128 values with D
// contiguous, three layers 128 -> 128 -> 128 -> 32 of bfloat16 weights and biases (contiguous
// (H, in, out) / (H, out)), one query MLP head per query head and one key MLP head per query head
// (per-query-head selection: group 1), one query row and one new key per sequence.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "encode_common.cuh"

namespace hashattention {
namespace cuda {

// One MLP problem: rows of x (B, Hx, L, 128) through head h's MLP (x head h / heads_per_x_head) into
// out[b * os0 + h * os1 + slot * os2], with slot = l, or positions[0] when positions is set (the key
// cache's slot of the new token; a slot outside [0, slots) is not written).
struct RowMlp {
  const __nv_bfloat16* x;
  int64_t xs0, xs1, xs2;
  int heads_per_x_head;
  const __nv_bfloat16* weights[3];  // (H, in, out) contiguous
  const __nv_bfloat16* biases[3];   // (H, out) contiguous
  int activation;                   // encode::Activation
  int32_t* out;
  int64_t os0, os1, os2;
  const int64_t* positions;
  int64_t slots;
};

struct QueryMlp {
  RowMlp query;  // the query-signature output (B, H, L, 1): chunk 0's block of each row writes it
  RowMlp key;    // the new key's signature into the cache (the row's last chunk's block writes it)
};

// Host side (csrc/cuda/signatures.cu): encode_pair_and_select's CUDA kernel records the MLPs of a
// query-signature output it left unwritten, then calls hamming_topk; the one-launch selection, when
// its query signatures start at that address, launches with them and consumes the record.
void record_pending_query_mlp(const QueryMlp& mlp);
bool peek_pending_query_mlp(const int32_t* query_signatures, QueryMlp& mlp);
void consume_pending_query_mlp();

namespace query_mlp_detail {

__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float (&f)[8]) {
  const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(words[i] << 16);
    f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

// Sum of `kValues` per-lane partials over the warp, scattered: after the call lane l holds the full
// sum of value index (l >> (5 - log2 kValues)) in v[0]. (kValues in {1, 2, 4, 8, 16}.)
template <int kValues>
__device__ __forceinline__ float reduce_scatter(float (&v)[16]) {
  const int lane = threadIdx.x & 31;
  int count = kValues;
#pragma unroll
  for (int offset = 16; offset >= 1; offset >>= 1) {
    if (count > 1) {
      const bool upper = (lane & offset) != 0;
      const int half = count / 2;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        if (k < half) {
          const float send = upper ? v[k] : v[k + half];
          const float keep = upper ? v[k + half] : v[k];
          v[k] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
        }
      }
      count = half;
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], offset);
    }
  }
  return v[0];
}

}  // namespace query_mlp_detail

// Asks L2 for head h's weights and biases (before the kernel's programmatic wait: the DRAM round trips
// then overlap the kernel before it, and the MLP's three dependent layers read from L2).
__device__ __forceinline__ void prefetch_row_mlp(const RowMlp& m, int h) {
  const int64_t elements[3] = {128 * 128, 128 * 128, 128 * 32};
  const int64_t outs[3] = {128, 128, 32};
#pragma unroll
  for (int l = 0; l < 3; ++l) {
    const char* w = reinterpret_cast<const char*>(m.weights[l] + h * elements[l]);
    for (int64_t line = int64_t(threadIdx.x) * 128; line < elements[l] * 2; line += int64_t(blockDim.x) * 128) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(w + line));
    }
    if (threadIdx.x == 0) asm volatile("prefetch.global.L2 [%0];" ::"l"(m.biases[l] + h * outs[l]));
  }
}

// The 32-bit signature of row (b, x head of h, l) through head h's MLP, computed by the whole block (256 threads, 8 warps)
// in float32 from bfloat16 inputs and weights; every thread gets it. `scratch`: >= 257 floats of
// shared memory, free for the call. Call from every thread (block barriers inside).
__device__ __forceinline__ unsigned signature_from_mlp(const RowMlp& m, int b, int h, int l, float* scratch) {
  using namespace query_mlp_detail;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* act = scratch;         // the current layer's 128 inputs
  float* next = scratch + 128;  // its outputs
  unsigned* signature = reinterpret_cast<unsigned*>(scratch + 256);
  const int64_t x_head = h / m.heads_per_x_head;
  // Each lane's biases, loaded up front: after the reductions they would be one more dependent L2
  // round trip per layer.
  float bias[3];
#pragma unroll
  for (int layer = 0; layer < 2; ++layer) {
    bias[layer] = __bfloat162float(m.biases[layer][int64_t(h) * 128 + 16 * warp + (lane >> 1)]);
  }
  bias[2] = __bfloat162float(m.biases[2][int64_t(h) * 32 + 4 * warp + (lane >> 3)]);
  if (threadIdx.x < 128) act[threadIdx.x] = __bfloat162float(m.x[b * m.xs0 + x_head * m.xs1 + l * m.xs2 + threadIdx.x]);
  if (threadIdx.x == 0) *signature = 0u;
  __syncthreads();
  // Layers 1-2 (128 -> 128): warp w owns outputs 16w .. 16w + 15, lane l inputs 4l .. 4l + 3.
#pragma unroll  // static layer indices: the kernel parameter's arrays stay in the constant bank
  for (int layer = 0; layer < 2; ++layer) {
    const __nv_bfloat16* w = m.weights[layer] + int64_t(h) * 128 * 128 + 16 * warp;
    float v[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] = 0.0f;
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {  // two rows of loads in flight at a time (48 registers per thread)
      uint4 rows[2][2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint4* row = reinterpret_cast<const uint4*>(w + (4 * lane + 2 * pair + r) * 128);
        rows[r][0] = __ldg(row);
        rows[r][1] = __ldg(row + 1);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float x = act[4 * lane + 2 * pair + r];
        float f[8];
        bf16x8_to_float(rows[r][0], f);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = fmaf(x, f[k], v[k]);
        bf16x8_to_float(rows[r][1], f);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[8 + k] = fmaf(x, f[k], v[8 + k]);
      }
    }
    const float sum = reduce_scatter<16>(v);
    const int o = 16 * warp + (lane >> 1);
    if ((lane & 1) == 0) {
      next[o] = encode::activate(sum + bias[layer], m.activation);
    }
    __syncthreads();
    float* t = act;
    act = next;
    next = t;
  }
  // Layer 3 (128 -> 32): warp w owns outputs 4w .. 4w + 3.
  {
    const __nv_bfloat16* w = m.weights[2] + int64_t(h) * 128 * 32 + 4 * warp;
    float v[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] = 0.0f;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = 4 * lane + r;
      const uint2 pair = __ldg(reinterpret_cast<const uint2*>(w + i * 32));
      const float x = act[i];
      v[0] = fmaf(x, __uint_as_float(pair.x << 16), v[0]);
      v[1] = fmaf(x, __uint_as_float(pair.x & 0xffff0000u), v[1]);
      v[2] = fmaf(x, __uint_as_float(pair.y << 16), v[2]);
      v[3] = fmaf(x, __uint_as_float(pair.y & 0xffff0000u), v[3]);
    }
    const float sum = reduce_scatter<4>(v);
    const int o = 4 * warp + (lane >> 3);
    if ((lane & 7) == 0 && sum + bias[2] > 0.0f) {
      atomicOr(signature, 1u << o);
    }
  }
  __syncthreads();
  return *signature;
}

// Stores a signature computed by signature_from_mlp for row (b, h, l) (thread 0 only).
__device__ __forceinline__ void store_signature(const RowMlp& m, int b, int h, int l, unsigned signature) {
  if (threadIdx.x != 0) return;
  int64_t slot = l;
  if (m.positions != nullptr) {
    slot = m.positions[0];
    if (slot < 0 || slot >= m.slots) return;
  }
  m.out[b * m.os0 + h * m.os1 + slot * m.os2] = static_cast<int32_t>(signature);
}

}  // namespace cuda
}  // namespace hashattention
