// Asynchronous 16-byte copies from global to shared memory (cp.async, sm_80+): the data skips the
// registers, and the issuing thread goes on until it waits. Used to stage the encoders' weights and
// the sparse attention's K/V rows. Below sm_80 (TORCH_CUDA_ARCH_LIST with older architectures) the
// copies are plain loads and stores, complete on return, and the waits do nothing.
#pragma once

#include <cuda_runtime.h>

namespace hashattention {
namespace cuda {

// 16 bytes, `.cg`: cached in L2 only (every byte is read once per block). Completes at
// copy_async_wait_all, or at copy_async_wait_pending once its group is old enough.
__device__ __forceinline__ void copy_async_16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(src) : "memory");
#else
  *static_cast<uint4*>(dst) = __ldg(static_cast<const uint4*>(src));
#endif
}

// As copy_async_16 when `fill`; otherwise the 16 bytes at dst become zero and src is not read
// (the hardware's zero fill: a source size of 0).
__device__ __forceinline__ void copy_async_16_or_zero(void* dst, const void* src, bool fill) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const unsigned bytes = fill ? 16u : 0u;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(src), "r"(bytes) : "memory");
#else
  *static_cast<uint4*>(dst) = fill ? __ldg(static_cast<const uint4*>(src)) : make_uint4(0, 0, 0, 0);
#endif
}

// Closes the calling thread's current group of copies (a group is the unit the waits count).
__device__ __forceinline__ void copy_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most `pending` (0-3) of the calling thread's committed groups are still in
// flight: every older group's bytes are then in shared memory and visible to this thread (to other
// threads only after a barrier). The count must be an immediate, hence the branches.
__device__ __forceinline__ void copy_async_wait_pending(int pending) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (pending <= 0) {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  } else if (pending == 1) {
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
  } else if (pending == 2) {
    asm volatile("cp.async.wait_group 2;\n" ::: "memory");
  } else {
    asm volatile("cp.async.wait_group 3;\n" ::: "memory");
  }
#endif
}

__device__ __forceinline__ void copy_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

}  // namespace cuda
}  // namespace hashattention
