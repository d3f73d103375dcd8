// Host side of programmatic_launch.cuh: which kernels run sm_90 code (and so may use clusters and
// programmatic dependent launch).
#include <map>
#include <mutex>
#include <utility>

#include "cuda_common.cuh"
#include "environment_overrides.h"

namespace hashattention {
namespace cuda {

bool kernel_built_for_sm90(const void* kernel) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, bool> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, kernel);
  auto it = cache.find(key);
  if (it == cache.end()) {
    cudaFuncAttributes attributes{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    const bool sm90 = at::cuda::getCurrentDeviceProperties()->major >= 9 && attributes.ptxVersion >= 90 &&
                      attributes.binaryVersion >= 90;
    it = cache.emplace(key, sm90).first;
  }
  return it->second;
}

bool programmatic_launch_allowed(const void* kernel) {
  return environment::programmatic_launch_enabled() && kernel_built_for_sm90(kernel);
}

}  // namespace cuda
}  // namespace hashattention
