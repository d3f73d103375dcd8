// Which few-rows encoder kernel a launch uses. HASHATTENTION_ENCODER is a timing aid for same-build
// A/B runs (scripts/bench_encode.py, the end-to-end benchmark); unset, the choice is automatic.
#pragma once

namespace hashattention {
namespace cuda {

enum class EncoderChoice {
  kAuto,      // unset: clusters of 2 blocks up to 4 rows per head, else tensor cores for 5-16 rows of
              //   bf16 weights, else the float32 FMA kernel (launch_fused, encode_fused.cu)
  kMma,       // "mma": the tensor-core kernel wherever it applies (encode_mma.cu)
  kFma,       // "fma": the float32 FMA kernel, one block per head and row group (encode_fused.cu)
  kCluster2,  // "cluster2" / "cluster4": each head's MLP split over a cluster of 2 / 4 blocks
  kCluster4,  //   wherever that kernel applies (encode_cluster.cu), else as unset
  kSkip,      // "skip": encode_signatures_pair_into launches nothing and returns an unwritten query
              //   output (wrong signatures; timing only: what a decode step costs without the encoder)
};

// Reads HASHATTENTION_ENCODER on every call (tests switch it between launches); raises on a value
// that is none of the above. Only encode_signatures_pair_into honours "skip"; the other ops run as unset.
EncoderChoice encoder_choice_from_environment();

}  // namespace cuda
}  // namespace hashattention
