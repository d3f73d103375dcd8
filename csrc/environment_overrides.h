// The environment variables the kernels read at run time -- all of them; docs/building.md
// documents each. Normal use sets none: they let tests reach code paths that the automatic
// choices do not take at test sizes, and let one build be timed both ways (A/B measurements).
//
// One rule for every variable: unset or empty means the automatic behaviour; any other value must
// be one of the listed values (or an integer in the stated range), else the op raises a
// RuntimeError naming the variable, the values it takes and the value it got. Each is read on
// every call, not cached, because tests switch them between calls; unset, a read is one getenv.
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include "message_text.h"

namespace hashattention {
namespace environment {

namespace detail {

// The variable's value; nullptr when it is unset or empty.
inline const char* value_of(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

// The index in `allowed` (words or integers) of the variable's value; -1 when it is unset.
template <typename T, size_t N>
int index_of_value(const char* name, const T (&allowed)[N]) {
  const char* value = value_of(name);
  if (value == nullptr) return -1;
  for (size_t i = 0; i < N; ++i) {
    if (std::string_view(value) == as_text(allowed[i])) return static_cast<int>(i);
  }
  std::string expected;
  for (size_t i = 0; i < N; ++i) {
    if (i > 0) expected += i + 1 < N ? ", " : " or ";
    expected += as_text(allowed[i]);
  }
  TORCH_CHECK(false, name, " must be ", expected, ", got '", value, "'");
}

// The variable's value as an integer in [lowest, highest]; nullopt when it is unset.
inline std::optional<int64_t> integer_value(const char* name, int64_t lowest, int64_t highest) {
  const char* value = value_of(name);
  if (value == nullptr) return std::nullopt;
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  TORCH_CHECK(end != value && *end == '\0' && parsed >= lowest && parsed <= highest, name,
              " must be an integer in [", as_text(lowest), ", ", as_text(highest), "], got '", value, "'");
  return parsed;
}

inline constexpr const char* kOffOn[] = {"0", "1"};

}  // namespace detail

// HASHATTENTION_POISON_OUTPUTS = 0 | 1 (unset: 0). 1: new_output (outputs.h) fills every op output
// with NaN (floats) or 0xDEADBEEF (integers) before the kernel runs, so that an element a kernel
// forgets to write fails a comparison instead of passing on zeroed memory. The test suite sets it.
inline bool poison_outputs() { return detail::index_of_value("HASHATTENTION_POISON_OUTPUTS", detail::kOffOn) == 1; }

// Which few-rows encoder kernel a CUDA encode launch uses (HASHATTENTION_ENCODER).
enum class EncoderChoice {
  kAuto,      // unset: clusters of 2 blocks up to 4 rows per head, else tensor cores for 5-16 rows of
              //   bf16 weights, else the float32 FMA kernel (launch_fused, encode_fused.cu)
  kFma,       // "fma": the float32 FMA kernel, one block per head and row group (encode_fused.cu)
  kMma,       // "mma": the tensor-core kernel wherever it applies (encode_mma.cu)
  kCluster2,  // "cluster2" / "cluster4": each head's MLP split over a cluster of 2 / 4 blocks
  kCluster4,  //   wherever that kernel applies (encode_cluster.cu), else as unset
  kSkip,      // "skip": encode_signatures_pair_into launches nothing and returns an unwritten query
              //   output (wrong signatures: what a decode step costs without its encoder); the
              //   other encode ops run as unset
};

// HASHATTENTION_ENCODER = fma | mma | cluster2 | cluster4 | skip (unset: kAuto); see EncoderChoice.
inline EncoderChoice encoder_choice() {
  static constexpr const char* kWords[] = {"fma", "mma", "cluster2", "cluster4", "skip"};
  static constexpr EncoderChoice kChoices[] = {EncoderChoice::kFma, EncoderChoice::kMma, EncoderChoice::kCluster2,
                                               EncoderChoice::kCluster4, EncoderChoice::kSkip};
  const int index = detail::index_of_value("HASHATTENTION_ENCODER", kWords);
  return index < 0 ? EncoderChoice::kAuto : kChoices[index];
}

// HASHATTENTION_SELECTION = chunked: the CUDA hamming_topk never takes its one-launch (resident)
// path, always the two-launch (chunked) one.
inline bool selection_chunked_only() {
  static constexpr const char* kWords[] = {"chunked"};
  return detail::index_of_value("HASHATTENTION_SELECTION", kWords) == 0;
}

// HASHATTENTION_SELECTION_CHUNK = one of `chunk_sizes` (the one-launch selection's positions per
// block): only that size is considered. 0 when unset.
template <size_t N>
int selection_chunk_size(const int (&chunk_sizes)[N]) {
  const int index = detail::index_of_value("HASHATTENTION_SELECTION_CHUNK", chunk_sizes);
  return index < 0 ? 0 : chunk_sizes[index];
}

// HASHATTENTION_SELECTION_RESIDENT_BLOCKS = 1 .. 2^30: the one-launch selection's grid holds at most
// this many resident blocks, so that small problems are cut into grid slices as large ones are.
inline std::optional<int64_t> selection_resident_blocks() {
  return detail::integer_value("HASHATTENTION_SELECTION_RESIDENT_BLOCKS", 1, int64_t(1) << 30);
}

// HASHATTENTION_ATTENTION_BLOCKS_PER_SM = 1 .. 64: the CUDA sparse_attention's target blocks per
// multiprocessor when it chooses the splits of each list (automatic: 4).
inline std::optional<int64_t> attention_blocks_per_sm() {
  return detail::integer_value("HASHATTENTION_ATTENTION_BLOCKS_PER_SM", 1, 64);
}

// HASHATTENTION_ATTENTION_MIN_ROWS = 1 .. 2^30: the fewest list entries per split of the CUDA
// sparse_attention (automatic: kMinRowsPerSplit, or kMinRowsPerSplitPipelined).
inline std::optional<int64_t> attention_min_rows() {
  return detail::integer_value("HASHATTENTION_ATTENTION_MIN_ROWS", 1, int64_t(1) << 30);
}

// HASHATTENTION_ATTENTION_CLUSTER = 0 .. largest: how the CUDA sparse_attention merges the splits of
// a list. 0 or 1: never in a thread-block cluster (the counters' merge); c >= 2: in clusters of at
// most c splits wherever they are resident, with fewer splits than the automatic rule if need be.
inline std::optional<int64_t> attention_cluster(int64_t largest) {
  return detail::integer_value("HASHATTENTION_ATTENTION_CLUSTER", 0, largest);
}

// HASHATTENTION_PROGRAMMATIC_LAUNCH = 0 | 1 (unset: 1). 0: no kernel is launched with programmatic
// stream serialization (the overlap with the kernel before it), on any GPU.
inline bool programmatic_launch_enabled() {
  return detail::index_of_value("HASHATTENTION_PROGRAMMATIC_LAUNCH", detail::kOffOn) != 0;
}

}  // namespace environment
}  // namespace hashattention
