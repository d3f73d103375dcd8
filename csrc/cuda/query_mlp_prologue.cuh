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
  RowMlp key;    // the new key's signature into the cache (chunk 1's block, chunk 0's in a one-chunk row)
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

// One layer of the block's matrix-vector product, 128 inputs -> kOut outputs (128 or 32). Thread t owns
// output group t % kGroups (8 consecutive outputs) and kInputs consecutive inputs from input group
// t / kGroups: one 16-byte load of weights per input, all of a layer's loads in flight at once (one L2
// round trip per layer), and 8 accumulators.
template <int kOut>
struct LayerTiling {
  static constexpr int kGroups = kOut / 8;             // output groups: 16 or 4
  static constexpr int kInputs = 128 * kGroups / 256;  // inputs per thread: 8 or 2
  static_assert(kOut == 128 || kOut == 32, "hidden layers of 128, signatures of 32 bits");

  // Issues the thread's weight loads for head h's layer (w: (H, 128, kOut) contiguous).
  static __device__ __forceinline__ void load(const __nv_bfloat16* w, int h, uint4 (&rows)[kInputs]) {
    const int group = threadIdx.x % kGroups, first = (threadIdx.x / kGroups) * kInputs;
    const __nv_bfloat16* head = w + int64_t(h) * 128 * kOut + group * 8;
#pragma unroll
    for (int r = 0; r < kInputs; ++r) rows[r] = __ldg(reinterpret_cast<const uint4*>(head + (first + r) * kOut));
  }

  // The thread's products with the layer inputs `act` (shared, 128 floats), summed over the warp's input
  // groups; lanes below kGroups write their output group's 8 sums to partials[warp * kOut + ...] (shared).
  static __device__ __forceinline__ void partial_sums(const uint4 (&rows)[kInputs], const float* act, float* partials) {
    const int group = threadIdx.x % kGroups, first = (threadIdx.x / kGroups) * kInputs, lane = threadIdx.x & 31;
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = 0.0f;
#pragma unroll
    for (int r = 0; r < kInputs; ++r) {
      const float x = act[first + r];
      float f[8];
      bf16x8_to_float(rows[r], f);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = fmaf(x, f[k], v[k]);
    }
#pragma unroll
    for (int offset = kGroups; offset < 32; offset <<= 1) {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], offset);
    }
    if (lane < kGroups) {
      float4* out = reinterpret_cast<float4*>(partials + (threadIdx.x >> 5) * kOut + group * 8);
      out[0] = make_float4(v[0], v[1], v[2], v[3]);
      out[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
  }

  // Output o's sum over the 8 warps' partials (call after a barrier, from threads o < kOut).
  static __device__ __forceinline__ float total(const float* partials, int o) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < 8; ++w) sum += partials[w * kOut + o];
    return sum;
  }
};

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

// The 32-bit signature of row (b, x head of h, l) through head h's MLP, computed by the whole block (256
// threads, 8 warps) in float32 from bfloat16 inputs and weights; every thread gets it. Shared memory free
// for the call: `scratch`, >= 257 floats, and `partials`, >= 1024 floats (16-byte aligned). Call from
// every thread (block barriers inside). Each layer's weight loads go out together, the first layer's
// with the input row's, and the next layer's while this one's partial sums are combined: about one L2
// round trip per layer on the chain. (The first version -- two round trips per hidden layer and its
// biases read after the sums -- made the selection 16 us per layer slower, H100, B = 2 / 128K.)
__device__ __forceinline__ unsigned signature_from_mlp(const RowMlp& m, int b, int h, int l, float* scratch,
                                                       float* partials) {
  using namespace query_mlp_detail;
  using Hidden = LayerTiling<128>;
  using Last = LayerTiling<32>;
  float* act = scratch;         // the current layer's 128 inputs
  float* next = scratch + 128;  // its outputs
  unsigned* signature = reinterpret_cast<unsigned*>(scratch + 256);
  const int t = threadIdx.x;
  uint4 rows[Hidden::kInputs];
  Hidden::load(m.weights[0], h, rows);
  // Thread t < 128 finishes output t of every layer: its biases and input value, loaded up front.
  float bias[3] = {0.0f, 0.0f, 0.0f};
  if (t < 128) {
    bias[0] = __bfloat162float(m.biases[0][int64_t(h) * 128 + t]);
    bias[1] = __bfloat162float(m.biases[1][int64_t(h) * 128 + t]);
    if (t < 32) bias[2] = __bfloat162float(m.biases[2][int64_t(h) * 32 + t]);
    act[t] = __bfloat162float(m.x[b * m.xs0 + int64_t(h / m.heads_per_x_head) * m.xs1 + l * m.xs2 + t]);
  }
  __syncthreads();
  uint4 last_rows[Last::kInputs];
#pragma unroll  // static layer indices: the kernel parameter's arrays stay in the constant bank
  for (int layer = 0; layer < 2; ++layer) {
    Hidden::partial_sums(rows, act, partials);
    // The next layer's weights, in flight while these sums are combined.
    if (layer == 0) Hidden::load(m.weights[1], h, rows);
    if (layer == 1) Last::load(m.weights[2], h, last_rows);
    __syncthreads();
    if (t < 128) next[t] = encode::activate(Hidden::total(partials, t) + bias[layer], m.activation);
    __syncthreads();
    float* swap = act;
    act = next;
    next = swap;
  }
  Last::partial_sums(last_rows, act, partials);
  __syncthreads();
  if (t < 32) {  // warp 0: bit t of the signature is output t's sign
    const unsigned bits = __ballot_sync(0xffffffffu, Last::total(partials, t) + bias[2] > 0.0f);
    if (t == 0) *signature = bits;
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
