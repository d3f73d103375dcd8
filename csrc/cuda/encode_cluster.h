// The few-rows encoder split over thread-block clusters (encode_cluster.cu). CUDA sources only.
#pragma once

#include <ATen/ATen.h>

#include "encode_common.cuh"

namespace hashattention {
namespace cuda {

// Launches the cluster kernel for `problems` (1 or 2) problems of one launch, each head's MLP on
// `cluster_blocks` (2 or 4) blocks of one cluster, and returns true; or returns false without
// launching when it does not apply: before sm_90, weights not float16 / bfloat16, more than 64 rows
// per head, a layer wider than 256 or not a power of two, widths not divisible by the cluster, or
// an output width not a multiple of 32.
bool launch_encode_cluster(const encode::FusedMlpLaunch& work, int problems, at::ScalarType x_type,
                           at::ScalarType weight_type, int cluster_blocks);

}  // namespace cuda
}  // namespace hashattention
