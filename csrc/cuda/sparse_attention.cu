// Host side of the CUDA `sparse_attention`: argument checks (shared with the CPU kernel),
// the unit/split decomposition from shapes only, and the dispatch to the kernel template
// instantiated per dtype in sparse_attention_{f32,f16,bf16}.cu.
//
// CUDA-graph safety: the workspace (partial states and per-unit counters) is sized from the
// shapes alone, the counters are zeroed by a memset on the stream, and no value is read on
// the host. Values the CPU kernel would reject are handled on the device instead: counts are
// clamped to [0, width], and entries outside [0, keys) -- or whose block-table page is outside
// [0, num_pages) -- are skipped like padding.
#include <torch/library.h>

#include <limits>
#include <numeric>
#include <tuple>

#include "checks.h"
#include "cuda_common.cuh"
#include "op_arguments.h"
#include "outputs.h"
#include "sparse_attention_kernel.cuh"

namespace hashattention {
namespace cuda {

namespace {

bool aligned_16(const at::Tensor& t, int64_t element_size, std::initializer_list<int64_t> strides) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int64_t s : strides) {
    if ((s * element_size) % 16 != 0) return false;
  }
  return true;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> sparse_attention_cuda(const at::Tensor& query, const at::Tensor& key_cache,
                                                         const at::Tensor& value_cache, const at::Tensor& indices,
                                                         const std::optional<at::Tensor>& counts,
                                                         const std::optional<at::Tensor>& block_table,
                                                         double scale) {
  const AttentionDims dims = check_attention_args(query, key_cache, value_cache, indices, counts, block_table);
  const c10::cuda::CUDAGuard guard(query.device());
  at::Tensor out = new_output({dims.batch, dims.query_heads, dims.rows, dims.head_dim}, query.options());
  at::Tensor lse = new_output({dims.batch, dims.query_heads, dims.rows}, query.options().dtype(at::kFloat));
  if (lse.numel() == 0) return {out, lse};

  AttentionParams p{};
  p.query = query.data_ptr();
  p.q_s0 = query.stride(0);
  p.q_s1 = query.stride(1);
  p.q_s2 = query.stride(2);
  p.key = key_cache.data_ptr();
  p.value = value_cache.data_ptr();
  p.k_s0 = key_cache.stride(0);
  p.k_s1 = key_cache.stride(1);
  p.k_s2 = key_cache.stride(2);
  p.v_s0 = value_cache.stride(0);
  p.v_s1 = value_cache.stride(1);
  p.v_s2 = value_cache.stride(2);
  if (dims.paged) {
    p.block_table = block_table->data_ptr<int32_t>();
    p.bt_s0 = block_table->stride(0);
    p.bt_s1 = block_table->stride(1);
    p.page_size = dims.page_size;
    p.num_pages = key_cache.size(0);
  }
  p.keys = dims.keys;
  p.indices = indices.data_ptr<int32_t>();
  p.i_s0 = indices.stride(0);
  p.i_s1 = indices.stride(1);
  p.i_s2 = indices.stride(2);
  if (counts.has_value()) {
    p.counts = counts->data_ptr<int32_t>();
    p.c_s0 = counts->stride(0);
    p.c_s1 = counts->stride(1);
    p.c_s2 = counts->stride(2);
  }
  p.width = dims.width;
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.query_heads = static_cast<int>(dims.query_heads);
  p.rows = static_cast<int>(dims.rows);
  p.heads_per_selection = static_cast<int>(dims.query_heads / dims.selection_heads);
  p.heads_per_kv = static_cast<int>(dims.query_heads / dims.kv_heads);
  p.unit_heads = std::gcd(p.heads_per_selection, p.heads_per_kv);
  const int max_heads = p.unit_heads == 1 ? 1 : (p.unit_heads <= 4 ? 4 : 8);
  p.subunits = static_cast<int>(ceil_div(p.unit_heads, max_heads));
  p.units_per_row = (p.query_heads / p.unit_heads) * p.subunits;
  const int64_t element_size = query.element_size();
  p.vector_loads = aligned_16(key_cache, element_size, {p.k_s0, p.k_s1, p.k_s2}) &&
                   aligned_16(value_cache, element_size, {p.v_s0, p.v_s1, p.v_s2});

  // Splits from shapes only: about 4 blocks per multiprocessor, each split at least one
  // 32-entry tile per warp, at most kMaxSplits (the in-kernel merge's shared-memory table).
  const int64_t units = dims.batch * dims.rows * p.units_per_row;
  const int64_t target_blocks = 4 * int64_t(multiprocessor_count());
  int64_t splits = std::max<int64_t>(1, ceil_div(target_blocks, units));
  splits = std::min(splits, std::max<int64_t>(1, ceil_div(dims.width, kMinRowsPerSplit)));
  int64_t rows_per_split = std::max<int64_t>(1, ceil_div(dims.width, splits));
  rows_per_split = std::max(rows_per_split, ceil_div(dims.width, kMaxSplits));
  splits = std::max<int64_t>(1, ceil_div(dims.width, rows_per_split));
  p.splits = static_cast<int>(splits);
  p.rows_per_split = static_cast<int>(rows_per_split);
  TORCH_CHECK(units <= std::numeric_limits<int32_t>::max(), "sparse_attention: too many (batch, row, head) units");

  at::Tensor partial, counters;
  if (splits > 1) {
    const int64_t states = units * splits * max_heads;
    partial = at::empty({states * (dims.head_dim + 2)}, query.options().dtype(at::kFloat));
    counters = at::zeros({units}, query.options().dtype(at::kInt));
    p.partial_acc = partial.data_ptr<float>();
    p.partial_max_sum = p.partial_acc + states * dims.head_dim;
    p.counters = counters.data_ptr<int>();
  }

  const dim3 grid(static_cast<unsigned>(units), static_cast<unsigned>(splits));
  auto stream = at::cuda::getCurrentCUDAStream();
  const int head_dim = static_cast<int>(dims.head_dim);
  switch (query.scalar_type()) {
    case at::kFloat:
      launch_sparse_attention<float>(p, head_dim, max_heads, grid, stream);
      break;
    case at::kHalf:
      launch_sparse_attention<c10::Half>(p, head_dim, max_heads, grid, stream);
      break;
    case at::kBFloat16:
      launch_sparse_attention<c10::BFloat16>(p, head_dim, max_heads, grid, stream);
      break;
    default:
      TORCH_CHECK_TYPE(false, "query must be float32, float16 or bfloat16, got ", as_text(query.scalar_type()));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

}  // namespace cuda

TORCH_LIBRARY_IMPL(hashattention, CUDA, m) { m.impl("sparse_attention", &cuda::sparse_attention_cuda); }

}  // namespace hashattention
