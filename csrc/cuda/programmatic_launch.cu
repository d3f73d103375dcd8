// Host side of programmatic dependent launch (see programmatic_launch.cuh):
// which kernels may be launched with the programmatic stream serialization attribute.
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "cuda_common.cuh"

namespace hashattention {
namespace cuda {

bool programmatic_launch_allowed(const void* kernel) {
  // Timing aid (A/B measurements of the launch overlap; never set outside them): "0" turns it off.
  const char* value = std::getenv("HASHATTENTION_PROGRAMMATIC_LAUNCH");
  if (value != nullptr && *value != '\0') {
    TORCH_CHECK(std::strcmp(value, "0") == 0 || std::strcmp(value, "1") == 0,
                "HASHATTENTION_PROGRAMMATIC_LAUNCH must be 0 or 1 (a timing aid), got '", value, "'");
    if (value[0] == '0') return false;
  }
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
    // ptxVersion: the virtual architecture the code came from, which decides whether the
    // griddepcontrol instructions are in it (SASS for sm_90 can come from compute_80 PTX).
    const bool allowed = at::cuda::getCurrentDeviceProperties()->major >= 9 && attributes.ptxVersion >= 90 &&
                         attributes.binaryVersion >= 90;
    it = cache.emplace(key, allowed).first;
  }
  return it->second;
}

}  // namespace cuda
}  // namespace hashattention
