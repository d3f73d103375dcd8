// Where a selection kernel gets the score of a candidate position: Hamming similarity
// computed on the fly from signatures, or a precomputed score tensor of any real dtype.
// Each source maps a score to an unsigned key whose integer order is the ranking order
// (higher key = better), so one radix-select kernel serves both.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "cuda_common.cuh"

namespace hashattention {
namespace cuda {

// Hamming similarity of key n for (b, s, l): sum over the group's query heads of
// 32 W - popcount(q XOR k). prepare() copies the group's query words into shared memory.
struct HammingSource {
  using key_t = uint32_t;
  static constexpr int kKeyBits = 32;

  const int32_t* q;
  int64_t qs0, qs1, qs2;
  const int32_t* k;
  int64_t ks0, ks1, ks2;
  int words, group, per_key;  // W, Hq / Hs, Hq / Hk
  int shared_key_head;        // 1 when all query heads of a group read the same key head
  // 1 when four consecutive positions of a key row are one aligned 16-byte load (used by the
  // fast path): W == 1, contiguous positions (ks2 == 1), a shared key head, 16-byte aligned rows.
  int vector_keys;

  // Per-row state, valid after prepare().
  const int32_t* q_words;  // shared memory, group * words
  const int32_t* key_row;  // key head of the group's first query head, at token 0
  int64_t b, s;

  // Copies the query words of `rows` consecutive selection heads s_ .. s_ + rows - 1 (their query
  // heads are consecutive too) to shared memory; row r's words start at r * group * words. The
  // key row is that of the first head: callers pass rows > 1 only when all of them share it.
  __device__ __forceinline__ void prepare(int64_t b_, int64_t s_, int64_t l, int32_t* smem, int rows = 1) {
    b = b_;
    s = s_;
    for (int i = threadIdx.x; i < rows * group * words; i += blockDim.x) {
      const int head = i / words, w = i % words;  // query head s * group + head
      smem[i] = q[b * qs0 + (s * group + head) * qs1 + l * qs2 + w];
    }
    q_words = smem;
    key_row = k + b * ks0 + ((s * group) / per_key) * ks1;
    __syncthreads();
  }

  // Loops are kept rolled: this is inlined into unrolled kernel loops, and unrolling it there
  // multiplied the code size past the instruction cache.
  __device__ __forceinline__ int32_t score(int64_t n) const {
    int32_t distance = 0;
    if (shared_key_head) {
      const int32_t* kr = key_row + n * ks2;
      if (words == 1) {
        const int32_t kw = kr[0];
#pragma unroll 1
        for (int g = 0; g < group; ++g) distance += __popc(static_cast<unsigned>(q_words[g] ^ kw));
      } else {
#pragma unroll 1
        for (int w = 0; w < words; ++w) {
          const int32_t kw = kr[w];
          for (int g = 0; g < group; ++g) distance += __popc(static_cast<unsigned>(q_words[g * words + w] ^ kw));
        }
      }
    } else {
#pragma unroll 1
      for (int g = 0; g < group; ++g) {
        const int32_t* kr = k + b * ks0 + ((s * group + g) / per_key) * ks1 + n * ks2;
        for (int w = 0; w < words; ++w) distance += __popc(static_cast<unsigned>(q_words[g * words + w] ^ kr[w]));
      }
    }
    return 32 * words * group - distance;
  }

  __device__ __forceinline__ key_t key(int64_t n) const { return static_cast<key_t>(score(n)); }
};

// Order-preserving maps to unsigned keys. Floating scores: NaN -> 0 (below every number),
// -0 -> +0 (they compare equal on the CPU), then the usual sign-flip trick.
__device__ __forceinline__ uint32_t float_key(float v) {
  if (v != v) return 0u;
  if (v == 0.0f) v = 0.0f;
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint64_t double_key(double v) {
  if (v != v) return 0ull;
  if (v == 0.0) v = 0.0;
  const uint64_t u = static_cast<uint64_t>(__double_as_longlong(v));
  return (u >> 63) ? ~u : (u | (1ull << 63));
}

template <typename scalar_t>
struct ScoreKeyTraits {  // signed or unsigned integers of at most 32 bits
  using key_t = uint32_t;
  static constexpr int kKeyBits = 32;
  __device__ __forceinline__ static key_t key(scalar_t v) {
    return static_cast<uint32_t>(static_cast<int32_t>(v)) ^ 0x80000000u;
  }
};
template <>
struct ScoreKeyTraits<int64_t> {
  using key_t = uint64_t;
  static constexpr int kKeyBits = 64;
  __device__ __forceinline__ static key_t key(int64_t v) { return static_cast<uint64_t>(v) ^ (1ull << 63); }
};
template <>
struct ScoreKeyTraits<double> {
  using key_t = uint64_t;
  static constexpr int kKeyBits = 64;
  __device__ __forceinline__ static key_t key(double v) { return double_key(v); }
};
template <>
struct ScoreKeyTraits<float> {
  using key_t = uint32_t;
  static constexpr int kKeyBits = 32;
  __device__ __forceinline__ static key_t key(float v) { return float_key(v); }
};
template <>
struct ScoreKeyTraits<c10::Half> {
  using key_t = uint32_t;
  static constexpr int kKeyBits = 32;
  __device__ __forceinline__ static key_t key(c10::Half v) { return float_key(static_cast<float>(v)); }
};
template <>
struct ScoreKeyTraits<c10::BFloat16> {
  using key_t = uint32_t;
  static constexpr int kKeyBits = 32;
  __device__ __forceinline__ static key_t key(c10::BFloat16 v) { return float_key(static_cast<float>(v)); }
};

// Scores read from a (B, Hs, L, N) tensor with any strides.
template <typename scalar_t>
struct TensorSource {
  using Traits = ScoreKeyTraits<scalar_t>;
  using key_t = typename Traits::key_t;
  static constexpr int kKeyBits = Traits::kKeyBits;

  const scalar_t* data;
  int64_t s0, s1, s2, s3;
  const scalar_t* row_data;

  __device__ __forceinline__ void prepare(int64_t b, int64_t s, int64_t l, int32_t*) {
    row_data = data + b * s0 + s * s1 + l * s2;
  }
  __device__ __forceinline__ key_t key(int64_t n) const { return Traits::key(row_data[n * s3]); }
};

}  // namespace cuda
}  // namespace hashattention
