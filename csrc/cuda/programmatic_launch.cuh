// Programmatic dependent launch (sm_90): device side, the host's check of which kernels may use it
// (programmatic_launch.cu), and the launch configuration that carries it.
#pragma once

#include <cuda_runtime.h>

namespace hashattention {
namespace cuda {

// A kernel launched with the programmatic stream serialization attribute may start while the
// kernel before it on the stream is still running: it must call wait_for_prerequisite_grids()
// before its first global-memory read (it returns once the earlier grids have finished and their
// writes are visible; without the attribute it returns at once). A kernel that calls allow_dependent_launch() lets such a successor be scheduled
// before it exits -- the successor still waits for all of its writes. Both compile to nothing
// before sm_90, and the host sets the attribute only for kernels built for sm_90 or later
// (programmatic_launch_allowed), since an older build has no wait in it.
__device__ __forceinline__ void wait_for_prerequisite_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether `kernel` runs sm_90 code on the current device: the device is sm_90 or later and the
// kernel's code came from sm_90 or later, both the PTX it was compiled from (ptxVersion: SASS for
// sm_90 can be JIT-compiled from compute_80 PTX, whose `#if __CUDA_ARCH__ >= 900` parts are empty)
// and the binary (binaryVersion). Only such kernels may use clusters, griddepcontrol or other sm_90
// instructions. Asked from the driver once per (device, kernel).
bool kernel_built_for_sm90(const void* kernel);

// Whether `kernel` may be launched with programmatic stream serialization: it is built for sm_90
// (kernel_built_for_sm90, so it holds the wait), and HASHATTENTION_PROGRAMMATIC_LAUNCH=0 (tests and
// A/B measurements of the overlap, environment_overrides.h) does not turn it off.
bool programmatic_launch_allowed(const void* kernel);

// A configuration for cudaLaunchKernelExC with the launch attributes this package uses: thread-block
// clusters, cooperative launch (every block resident at once) and programmatic stream serialization
// (the kernel must then wait as above). Not copyable: the configuration points at its own attributes.
struct KernelLaunch {
  cudaLaunchAttribute attributes[3]{};
  cudaLaunchConfig_t config{};

  KernelLaunch(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream) {
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = shared_bytes;
    config.stream = stream;
    config.attrs = attributes;
  }
  KernelLaunch(const KernelLaunch&) = delete;
  KernelLaunch& operator=(const KernelLaunch&) = delete;

  void cluster(dim3 dims) {
    cudaLaunchAttribute& a = attributes[config.numAttrs++];
    a.id = cudaLaunchAttributeClusterDimension;
    a.val.clusterDim.x = dims.x;
    a.val.clusterDim.y = dims.y;
    a.val.clusterDim.z = dims.z;
  }
  void cooperative() {
    cudaLaunchAttribute& a = attributes[config.numAttrs++];
    a.id = cudaLaunchAttributeCooperative;
    a.val.cooperative = 1;
  }
  void programmatic() {
    cudaLaunchAttribute& a = attributes[config.numAttrs++];
    a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a.val.programmaticStreamSerializationAllowed = 1;
  }
};

}  // namespace cuda
}  // namespace hashattention
