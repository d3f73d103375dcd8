// CUDA kernels of `hamming_topk` and `topk_from_scores`: exact top-k selection with the
// sink/local budget contract of selection_window.h, identical to the CPU kernels (same set,
// same order, ties to the later position, -1 padding, counts); and of `hamming_scores`, the
// scores hamming_topk selects by, written out.
//
// The counting paths of hamming_topk live in hamming_topk_resident.cu (one launch, when the whole
// selection fits on chip: batch-1 decode steps) and hamming_topk_fast.cu (two launches, any size,
// when a row's scores take at most kFastBins values). Every other case (larger score ranges, and
// topk_from_scores for any dtype) runs here, one block per row: an exact radix select over
// order-preserving keys, 8 bits per pass, then an ordered compaction.
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "checks.h"
#include "cuda_common.cuh"
#include "hamming_topk_fast.h"
#include "hamming_topk_resident.h"
#include "op_arguments.h"
#include "outputs.h"
#include "selection_sources.cuh"

namespace hashattention {
namespace cuda {
namespace {

constexpr int kItems = 4;             // elements per thread per tile of the radix-select path
constexpr int64_t kFastBins = 2049;   // score ranges the counting fast path handles

__device__ __forceinline__ void row_coordinates(const SelectionParams& p, int64_t row, int64_t& b, int64_t& s,
                                                int64_t& l) {
  l = row % p.rows;
  s = (row / p.rows) % p.heads;
  b = row / (p.rows * p.heads);
}

// ---- hamming_scores ---------------------------------------------------------------------------
// One thread per output score; the query words of a row are the same for a whole warp
// (L1 broadcast), the key words are read coalesced along N.
__global__ void __launch_bounds__(kThreads)
    hamming_scores_kernel(const int32_t* __restrict__ q, int64_t qs0, int64_t qs1, int64_t qs2,
                          const int32_t* __restrict__ k, int64_t ks0, int64_t ks1, int64_t ks2,
                          int32_t* __restrict__ out, int64_t total, int64_t keys, int64_t rows,
                          int64_t selection_heads, int64_t group, int64_t per_key, int64_t words) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t n = i % keys;
    const int64_t row = i / keys;
    const int64_t l = row % rows;
    const int64_t s = (row / rows) % selection_heads;
    const int64_t b = row / (rows * selection_heads);
    int32_t score = 0;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = s * group + g;
      const int32_t* qr = q + b * qs0 + h * qs1 + l * qs2;
      const int32_t* kr = k + b * ks0 + (h / per_key) * ks1 + n * ks2;
      int32_t distance = 0;
      for (int64_t w = 0; w < words; ++w) distance += __popc(static_cast<unsigned>(qr[w] ^ kr[w]));
      score += static_cast<int32_t>(32 * words) - distance;
    }
    out[i] = score;
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

}  // namespace

at::Tensor hamming_scores_cuda(const at::Tensor& query_signatures, const at::Tensor& key_signatures,
                               int64_t selection_heads) {
  const HammingDims dims = check_hamming_args(query_signatures, key_signatures, selection_heads);
  const c10::cuda::CUDAGuard guard(query_signatures.device());
  at::Tensor out = new_output({dims.batch, dims.selection_heads, dims.rows, dims.keys},
                             query_signatures.options().dtype(at::kInt));
  const int64_t total = out.numel();
  if (total == 0) return out;
  const auto& q = query_signatures;
  const auto& k = key_signatures;
  const int64_t blocks = std::min<int64_t>(ceil_div(total, kThreads), int64_t(multiprocessor_count()) * 32);
  hamming_scores_kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      q.data_ptr<int32_t>(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr<int32_t>(), k.stride(0),
      k.stride(1), k.stride(2), out.data_ptr<int32_t>(), total, dims.keys, dims.rows, dims.selection_heads,
      dims.heads_per_selection(), dims.query_heads_per_key_head(), dims.words);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor> hamming_topk_cuda(const at::Tensor& query_signatures,
                                                     const at::Tensor& key_signatures,
                                                     const std::optional<at::Tensor>& lengths,
                                                     const std::optional<at::Tensor>& start_positions,
                                                     const std::optional<at::Tensor>& budgets,
                                                     int64_t selection_heads, int64_t sink_tokens,
                                                     int64_t local_tokens, int64_t budget_tokens) {
  const HammingDims dims = check_hamming_args(query_signatures, key_signatures, selection_heads);
  const SelectionArgs args =
      check_selection_args(lengths, start_positions, budgets, dims.batch, query_signatures, "query_signatures",
                           dims.keys, "key_signatures", sink_tokens, local_tokens, budget_tokens);
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

  if (launch_hamming_topk_resident(p, src, row_count, query_signatures)) return {indices, counts};
  if (dims.max_score() + 1 <= kFastBins) {
    launch_hamming_topk_fast(p, src, row_count, static_cast<int>(dims.max_score() + 1), query_signatures);
  } else {
    const size_t q_bytes = sizeof(int32_t) * src.group * src.words;
    TORCH_CHECK(q_bytes <= kDefaultSmem, "hamming_topk: query signatures of a group exceed shared memory");
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
  m.impl("hamming_scores", &cuda::hamming_scores_cuda);
  m.impl("hamming_topk", &cuda::hamming_topk_cuda);
  m.impl("topk_from_scores", &cuda::topk_from_scores_cuda);
}

}  // namespace hashattention
