// The tensor-core kernel of the few-rows encoder (encode_mma.cu). CUDA sources only.
#pragma once

#include <ATen/ATen.h>

#include "encode_common.cuh"

namespace hashattention {
namespace cuda {

// Runs `problems` (1 or 2) problems of `launch` in one launch of the tensor-core kernel and returns
// true, or returns false without launching when it does not apply: bfloat16 weights and biases,
// 16-byte aligned; every layer width a multiple of 16 and at most 256; 5 to 16 rows per head (at
// most 4, the float32 kernel is as fast); sm_80 or later. HASHATTENTION_ENCODER overrides the row
// rule: "mma" takes this kernel from one row, "fma" never. The caller then launches the float32
// kernel.
bool launch_encode_mma(const encode::FusedMlpLaunch& launch, int problems, at::ScalarType x_type,
                       at::ScalarType weight_type);

}  // namespace cuda
}  // namespace hashattention
