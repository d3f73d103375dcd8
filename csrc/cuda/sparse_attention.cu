// Host side of the CUDA `sparse_attention`: argument checks (shared with the CPU kernel),
// the unit/split decomposition from shapes only, and the dispatch to the kernel template
// instantiated per dtype in sparse_attention_{f32,f16,bf16}.cu.
//
// CUDA-graph safety: the workspace (partial states and per-unit counters, only when the splits
// of a unit are not one thread-block cluster) is sized from the shapes alone, the counters are
// zeroed by a memset on the stream (or come zeroed in the caller's workspace, which the kernel
// leaves zeroed), and no value is read on the host. The kernel waits for the
// grids before it (wait_for_prerequisite_grids) before its first read, so it may be launched
// programmatically after the selection. Values the CPU kernel would reject are handled on the
// device instead: counts are clamped to [0, width], and entries outside [0, keys) -- or whose
// block-table page is outside [0, num_pages) -- are skipped like padding.
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <tuple>
#include <utility>

#include "checks.h"
#include "cuda_common.cuh"
#include "environment_overrides.h"
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

// Resident blocks of `kernel` per multiprocessor: fixed by the kernel and the device, so asked
// from the driver once per (device, kernel).
int64_t resident_blocks_per_sm(AttentionKernel kernel) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, int> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, reinterpret_cast<const void*>(kernel));
  auto it = cache.find(key);
  if (it == cache.end()) {
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kAttentionThreads, 0));
    it = cache.emplace(key, std::max(blocks, 1)).first;
  }
  return it->second;
}

// Clusters of `size` blocks of `kernel` that the device holds at once (0 where clusters of that
// size cannot run: before sm_90, or a kernel whose code is not sm_90's -- its cluster merge would
// trap), asked from the driver once per (device, kernel, size).
int64_t resident_clusters(AttentionKernel kernel, int size) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int>, int> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(device, reinterpret_cast<const void*>(kernel), size);
  auto it = cache.find(key);
  if (it == cache.end()) {
    int clusters = 0;
    if (kernel_built_for_sm90(reinterpret_cast<const void*>(kernel)) && size <= kMaxClusterSplits) {
      if (size > 8) {  // beyond the portable cluster size: opt in
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
      }
      KernelLaunch launch(dim3(1, static_cast<unsigned>(size)), dim3(kAttentionThreads), 0, nullptr);
      launch.cluster(dim3(1, static_cast<unsigned>(size), 1));
      if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &launch.config) != cudaSuccess) {
        (void)cudaGetLastError();  // not launchable as such a cluster: use the counters
        clusters = 0;
      }
    }
    it = cache.emplace(key, clusters).first;
  }
  return it->second;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> sparse_attention_cuda(const at::Tensor& query, const at::Tensor& key_cache,
                                                         const at::Tensor& value_cache, const at::Tensor& indices,
                                                         const std::optional<at::Tensor>& counts,
                                                         const std::optional<at::Tensor>& block_table,
                                                         double scale, const std::optional<at::Tensor>& workspace) {
  const AttentionDims dims = check_attention_args(query, key_cache, value_cache, indices, counts, block_table);
  check_attention_workspace(workspace, query, dims);
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

  // The kernel (one per dtype, head dim and heads per block): see sparse_attention_kernel.cuh for
  // why blocks of several heads run the pipelined main loop.
  const int head_dim = static_cast<int>(dims.head_dim);
  AttentionKernel kernel = nullptr;
  switch (query.scalar_type()) {
    case at::kFloat: kernel = attention_kernel<float>(head_dim, max_heads); break;
    case at::kHalf: kernel = attention_kernel<c10::Half>(head_dim, max_heads); break;
    case at::kBFloat16: kernel = attention_kernel<c10::BFloat16>(head_dim, max_heads); break;
    default: TORCH_CHECK_TYPE(false, "query must be float32, float16 or bfloat16, got ", as_text(query.scalar_type()));
  }
  TORCH_CHECK(kernel != nullptr, "sparse_attention: internal error, no kernel for head_dim ", head_dim, " and ",
              max_heads, " heads per block");
  const bool pipelined = max_heads > 1;

  // Splits from shapes only: about 4 blocks per multiprocessor (fewer when fewer are resident),
  // never more blocks than one resident wave when the units fit one (a second, partial wave
  // doubles the tail: H200, group-shared B = 4 / 128K, 56 -> 43 us), at least kMinRowsPerSplit
  // rows each (kMinRowsPerSplitPipelined for the pipelined loop), at most kMaxSplits (the
  // in-kernel merge's shared-memory table). HASHATTENTION_ATTENTION_BLOCKS_PER_SM and
  // HASHATTENTION_ATTENTION_MIN_ROWS replace the 4 and the minimum rows: tests force few large or
  // many small splits with them.
  const int64_t sms = multiprocessor_count();
  const int64_t resident = sms * resident_blocks_per_sm(kernel);
  const int64_t units = dims.batch * dims.rows * p.units_per_row;
  const int64_t blocks_per_sm = environment::attention_blocks_per_sm().value_or(4);
  const int64_t min_rows =
      environment::attention_min_rows().value_or(pipelined ? kMinRowsPerSplitPipelined : kMinRowsPerSplit);
  int64_t splits = std::max<int64_t>(1, ceil_div(std::min(blocks_per_sm * sms, resident), units));
  if (units <= resident) splits = std::min(splits, resident / units);
  splits = std::min(splits, std::max<int64_t>(1, ceil_div(dims.width, min_rows)));
  int64_t rows_per_split = std::max<int64_t>(1, ceil_div(dims.width, splits));
  rows_per_split = std::max(rows_per_split, ceil_div(dims.width, kMaxSplits));
  splits = std::max<int64_t>(1, ceil_div(dims.width, rows_per_split));

  // The splits of a unit merge inside one thread-block cluster when they can be one (at most
  // kMaxClusterSplits) and every unit's cluster is resident at once; a unit may then take up to an
  // eighth fewer splits than the rule above gives (B = 1, 32 query heads: 16 splits of a cluster
  // instead of 17). The other merge, through global counters, needs a memset of the counters
  // before the kernel, and with that node between the selection and this kernel the attention
  // cannot be launched programmatically. H200, attention alone, cluster vs counters: B = 1 per query
  // head 12.2-12.4 vs 13.4-13.7 us at 32K, 24.5-24.8 vs 25.7-26.4 at 128K, level at 512K; where the
  // grid fills the resident slots (B = 4 per query head, 640 of 660 blocks) clusters slowed the
  // attention alone by ~1.6 us (B = 4 / 32K 24.8-25.4 vs 24.2-24.5 us). Allowing a quarter fewer
  // splits (B = 4 per query head: clusters of 4 instead of the counters' 5) was measured and
  // dropped: the B = 4 / 128K / 32x decode step in the model was 9.03 ms against 9.07-9.08 with the
  // counters (a single 8.74 ms did not repeat), and benchmarks/decode_attention.py at B = 8 / 128K
  // group-shared, which it also moved to clusters, was slower: 97.1 vs 90.8 us at 32x, 161.2 vs
  // 146.2 at 16x. HASHATTENTION_ATTENTION_CLUSTER = 0 or 1: never; c >= 2: clusters of at most c
  // splits whenever they are resident, with fewer splits than the rule gives if need be.
  const int64_t forced_cluster = environment::attention_cluster(kMaxClusterSplits).value_or(-1);
  const int64_t largest_cluster = forced_cluster < 0 ? kMaxClusterSplits : forced_cluster;
  const int64_t smallest_cluster = std::max<int64_t>(2, forced_cluster < 0 ? ceil_div(7 * splits, 8) : 2);
  bool cluster_merge = false;
  for (int64_t size = std::min(splits, largest_cluster); splits > 1 && size >= smallest_cluster; --size) {
    const int64_t cluster_rows = ceil_div(dims.width, size);
    const int64_t cluster_splits = ceil_div(dims.width, cluster_rows);
    if (cluster_splits >= 2 && units <= resident_clusters(kernel, static_cast<int>(cluster_splits))) {
      splits = cluster_splits;
      rows_per_split = cluster_rows;
      cluster_merge = true;
      break;
    }
  }
  p.splits = static_cast<int>(splits);
  p.rows_per_split = static_cast<int>(rows_per_split);
  p.cluster_merge = cluster_merge ? 1 : 0;
  TORCH_CHECK(units <= std::numeric_limits<int32_t>::max(), "sparse_attention: too many (batch, row, head) units");

  // The counters' merge: a zeroed counter per unit. The caller's workspace is zero already (each
  // unit's last block resets its counter), so no memset node sits before the kernel and it can be
  // launched programmatically (B = 4 per query head: ~1 memset and 2 graph-node gaps per layer).
  at::Tensor partial, counters;
  bool counters_memset = false;
  if (splits > 1 && !cluster_merge) {
    const int64_t states = units * splits * max_heads;
    partial = at::empty({states * (dims.head_dim + 2)}, query.options().dtype(at::kFloat));
    counters_memset = !workspace.has_value();
    counters = counters_memset ? at::zeros({units}, query.options().dtype(at::kInt)) : *workspace;
    p.partial_acc = partial.data_ptr<float>();
    p.partial_max_sum = p.partial_acc + states * dims.head_dim;
    p.counters = counters.data_ptr<int>();
  }

  const dim3 grid(static_cast<unsigned>(units), static_cast<unsigned>(splits));
  void* args[] = {&p};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Clusters of (1, splits) -- a unit's splits, as the cluster merge needs -- and programmatic stream
  // serialization: the kernel may start while the selection before it finishes (its blocks are
  // placed and run up to their wait while the selection's last blocks write. H200, B = 1, 32x,
  // select + attend per query head: 42.3 -> 40.9 us at 128K, 21.3 -> 20.0-20.5 at 32K, level at
  // 512K), but only where no counters' memset sits between the selection and this kernel
  // (programmatic edges join two kernels; the memset must stay ordered before every block).
  KernelLaunch launch(grid, dim3(kAttentionThreads), 0, stream);
  if (cluster_merge) launch.cluster(dim3(1, static_cast<unsigned>(splits), 1));
  if (!counters_memset && programmatic_launch_allowed(reinterpret_cast<const void*>(kernel))) launch.programmatic();
  C10_CUDA_CHECK(cudaLaunchKernelExC(&launch.config, reinterpret_cast<const void*>(kernel), args));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

}  // namespace cuda

TORCH_LIBRARY_IMPL(hashattention, CUDA, m) { m.impl("sparse_attention", &cuda::sparse_attention_cuda); }

}  // namespace hashattention
