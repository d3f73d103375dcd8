// The one place where the operator schemas of `torch.ops.hashattention.*` are declared.
//
// Kernels register themselves per device in their own files (TORCH_LIBRARY_IMPL); fake
// (meta) kernels for torch.compile live next to the Python wrappers in hashattention/ops.py.
// The semantics of every op are documented in hashattention/ops.py and README.md.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// Importing `hashattention._C` from Python loads this shared library, which runs the
// static TORCH_LIBRARY initialisers below and so registers the ops with the dispatcher.
// The module itself is empty apart from a flag telling whether CUDA kernels were built.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "Compiled kernels of hashattention (ops register on import).", -1,
      nullptr,
  };
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
#ifdef HASHATTENTION_WITH_CUDA
  PyModule_AddIntConstant(module, "with_cuda", 1);
#else
  PyModule_AddIntConstant(module, "with_cuda", 0);
#endif
  return module;
}
}

TORCH_LIBRARY(hashattention, m) {
  // Per-head MLP -> sign -> packed bits. x: (B, H, N, D); weights[i]: (H, in_i, out_i);
  // biases[i]: (H, out_i). Returns int32 (B, H, N, out_last / 32).
  m.def("encode_signatures(Tensor x, Tensor[] weights, Tensor[] biases, str activation=\"silu\") -> Tensor");
  // A decode step's two encodes in one call (one CUDA launch): exactly
  // (encode_signatures(query, query_weights, query_biases), encode_signatures(key expanded, key_weights,
  // key_biases)), where key (B, Hx, N, D) may have fewer heads than key_weights (Hx divides them;
  // key-signature head h reads key head h // (Hk / Hx)). Query and key may differ in B, N, D, widths.
  m.def(
      "encode_signatures_pair(Tensor query, Tensor[] query_weights, Tensor[] query_biases, Tensor key, "
      "Tensor[] key_weights, Tensor[] key_biases, str activation=\"silu\") -> (Tensor query_signatures, "
      "Tensor key_signatures)");
  // The same two encodes, with the key signatures stored into a cache instead of returned:
  // key_signatures[b, h, positions[n], :] = the key signatures of key[b, :, n] for every n (the slots a
  // decode step appended); returns the query signatures. key_signatures: int32 (B', Hk, S, Wk);
  // positions: int64 (N,), distinct, in [0, S).
  m.def(
      "encode_signatures_pair_into(Tensor query, Tensor[] query_weights, Tensor[] query_biases, Tensor key, "
      "Tensor[] key_weights, Tensor[] key_biases, Tensor(a!) key_signatures, Tensor positions, "
      "str activation=\"silu\") -> Tensor");
  // A decode step's selection from the query rows: encode_signatures_pair_into, then hamming_topk with
  // the query signatures it returned (and key_signatures, with the new keys stored). Returns (indices,
  // counts, query_signatures).
  m.def(
      "encode_pair_and_select(Tensor query, Tensor[] query_weights, Tensor[] query_biases, Tensor key, "
      "Tensor[] key_weights, Tensor[] key_biases, Tensor(a!) key_signatures, Tensor positions, str activation, "
      "int selection_heads, int sink_tokens, int local_tokens, int budget_tokens, Tensor? lengths=None, "
      "Tensor? start_positions=None, Tensor? budgets=None) -> (Tensor indices, Tensor counts, "
      "Tensor query_signatures)");
  // Float (..., bits) -> int32 (..., bits / 32); bit j of word w is 1 iff values[..., 32w + j] > 0.
  m.def("pack_signs(Tensor values) -> Tensor");
  // Similarity = bits - popcount(q XOR k) summed over words (and over a group's query heads
  // when selection_heads < query heads). Returns int32 (B, selection_heads, L, N).
  m.def("hamming_scores(Tensor query_signatures, Tensor key_signatures, int selection_heads) -> Tensor");
  // Fused Hamming scoring + exact top-k selection with sink/local windows.
  // Returns (indices int32 (B, Hs, L, sink+local+budget), counts int32 (B, Hs, L)).
  m.def(
      "hamming_topk(Tensor query_signatures, Tensor key_signatures, Tensor? lengths, "
      "Tensor? start_positions, Tensor? budgets, int selection_heads, int sink_tokens, "
      "int local_tokens, int budget_tokens) -> (Tensor indices, Tensor counts)");
  // The same selection contract from precomputed scores (B, Hs, L, N) of any real dtype.
  m.def(
      "topk_from_scores(Tensor scores, Tensor? lengths, Tensor? start_positions, Tensor? budgets, "
      "int sink_tokens, int local_tokens, int budget_tokens) -> (Tensor indices, Tensor counts)");
  // Exact softmax attention over the KV rows named by `indices` (page size 1 semantics).
  // Returns (out (B, Hq, L, D) in the query dtype, lse float32 (B, Hq, L)). workspace: int32, at
  // least B * Hq * L elements, contiguous, all zero on entry and left all zero (the CUDA kernel's
  // split counters, which it then need not clear first); calls sharing one must not overlap.
  m.def(
      "sparse_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor indices, "
      "Tensor? counts, Tensor? block_table, float scale, Tensor(a!)? workspace=None) -> (Tensor out, Tensor lse)");
}
