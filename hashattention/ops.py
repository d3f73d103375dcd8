"""Documented wrappers of ``torch.ops.hashattention.*``, with their fake kernels beside them.

The fake (meta) kernels compute output shapes only; they let the ops run under
``torch.compile`` and inside CUDA graphs. The argument checks live in the C++ kernels
(``csrc/op_arguments.cpp``), shared by all devices. Python adds two that the kernels cannot
make: the fakes reject a mix of devices (a mix that includes a ``meta`` tensor dispatches to
the fake, not to a device kernel), and the wrappers name an integer argument too large for
the schema's 64-bit ``int``, which torch would reject without naming it.

Conventions used throughout:

* ``B`` batch, ``Hq`` query heads, ``Hkv`` KV heads, ``Hk`` key-signature heads (``Hq`` or
  ``Hkv``), ``Hs`` selection heads (``Hq``: each query head selects its own tokens; ``Hkv``:
  the query heads of a KV group share one selection), ``L`` query rows in the chunk,
  ``N`` cached keys, ``D`` head dim, ``W`` int32 words per signature (bits = 32 W).
* Query head ``h`` uses key-signature head ``h // (Hq // Hk)``, selection head
  ``h // (Hq // Hs)`` and KV head ``h // (Hq // Hkv)``.
* Row ``l`` of a chunk of ``L`` query rows sits at position ``length - L + l`` and is causal.
* Index-like tensors (lengths, start positions, budgets, indices, counts, block tables)
  are int32; per-sequence ones have shape ``(B,)`` and stay on the device (never read on
  the host by the CUDA kernels; the CPU kernels validate their values).

Errors: shape and value problems raise ``ValueError``, dtype problems ``TypeError``; each
message names the argument and what was expected.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

SUPPORTED_HEAD_DIMS = (64, 128, 256)

_INT64_RANGE = (-(2**63), 2**63 - 1)
_WINDOW_RANGE = "[0, 2^31 - 1]"  # the kernels' range of sink_tokens, local_tokens and budget_tokens


def _check_schema_int(name: str, value, expected: str) -> None:
    """ValueError naming ``name`` for a Python int outside int64, which the op's schema cannot carry.

    Values inside int64 reach the kernels, whose checks enforce the range ``expected`` (for the
    window sizes with this message); torch's own message for a larger int names neither the
    argument nor the range.
    """
    if isinstance(value, int) and not _INT64_RANGE[0] <= value <= _INT64_RANGE[1]:
        raise ValueError(f"{name} must be {expected}, got {value}")


def _check_selection_ints(selection_heads, sink_tokens, local_tokens, budget_tokens) -> None:
    if selection_heads is not None:
        _check_schema_int("selection_heads", selection_heads, "a divisor of the query heads")
    _check_schema_int("sink_tokens", sink_tokens, f"in {_WINDOW_RANGE}")
    _check_schema_int("local_tokens", local_tokens, f"in {_WINDOW_RANGE}")
    _check_schema_int("budget_tokens", budget_tokens, f"in {_WINDOW_RANGE}")


def _check_same_device(reference_name: str, reference: Tensor, **others) -> None:
    """The fake kernels' device check, worded as the kernels' (``csrc/checks.h``).

    Each of ``others`` is a tensor, None, or a list of tensors (named ``name[i]``). A mix of
    devices that includes ``meta`` dispatches to the fake kernel, which would otherwise return
    uninitialised tensors on the reference's device. All-meta and all-fake inputs (torch.compile,
    FakeTensorMode) share one device and pass.
    """
    for name, value in others.items():
        is_list = isinstance(value, (list, tuple))
        for item_name, tensor in [(f"{name}[{i}]", t) for i, t in enumerate(value)] if is_list else [(name, value)]:
            if tensor is not None and tensor.device != reference.device:
                raise ValueError(
                    f"{item_name} is on {tensor.device} but {reference_name} is on {reference.device}; "
                    "all tensors must be on the same device"
                )


def encode_signatures(
    x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor], activation: str = "silu"
) -> Tensor:
    """Per-head MLP -> sign -> bits packed into int32 words.

    Args:
        x: ``(B, H, N, D)`` float32/float16/bfloat16 -- queries or keys, one MLP per head.
        weights: per layer ``(H, in_features, out_features)`` (note: ``x @ W``, not
            ``nn.Linear``'s ``[out, in]``); the first ``in_features`` is ``D``, the last
            ``out_features`` (the signature bits) a multiple of 32. float32, float16 or bfloat16 (not float64).
        biases: per layer ``(H, out_features)``.
        activation: applied between layers (not after the last): ``"silu"`` (default),
            ``"relu"``, ``"gelu"``, ``"tanh"`` or ``"identity"``.

    Returns:
        int32 ``(B, H, N, bits // 32)``: bit ``j`` of word ``w`` is 1 iff output unit
        ``32 w + j`` of the MLP is > 0.

    The CPU kernel computes in float32; values within rounding error of 0 may get either bit
    on different devices.
    """
    return torch.ops.hashattention.encode_signatures.default(x, list(weights), list(biases), activation)


@torch.library.register_fake("hashattention::encode_signatures")
def _encode_signatures_fake(x, weights, biases, activation="silu"):
    _check_same_device("x", x, weights=weights, biases=biases)
    bits = weights[-1].shape[-1]
    return x.new_empty((*x.shape[:-1], bits // 32), dtype=torch.int32)


def encode_signatures_pair(
    query: Tensor,
    query_weights: Sequence[Tensor],
    query_biases: Sequence[Tensor],
    key: Tensor,
    key_weights: Sequence[Tensor],
    key_biases: Sequence[Tensor],
    activation: str = "silu",
) -> Tuple[Tensor, Tensor]:
    """A decode step's query and key signatures in one call (one fused CUDA launch).

    Exactly ``(encode_signatures(query, query_weights, query_biases, activation),
    encode_signatures(key_expanded, key_weights, key_biases, activation))``, where ``key`` may
    have fewer heads than the key MLP stack: key-signature head ``h`` reads key head
    ``h // (Hk // Hx)`` (KV-head keys for per-query-head key MLPs, without a repeated copy).

    Args:
        query: ``(B, Hq, L, D)`` float32/float16/bfloat16.
        query_weights, query_biases: the query MLP stack, as in :func:`encode_signatures`
            (``(Hq, in, out)`` and ``(Hq, out)`` per layer).
        key: ``(B', Hx, N, D')`` float32/float16/bfloat16, with ``Hx`` dividing ``Hk``; ``B``,
            ``N``, ``D`` and the dtype may differ from the query's.
        key_weights, key_biases: the key MLP stack, ``(Hk, in, out)`` and ``(Hk, out)`` per
            layer; the first ``in`` is ``D'``.
        activation: shared by both stacks (see :func:`encode_signatures`).

    Returns:
        ``(query_signatures, key_signatures)``: int32 ``(B, Hq, L, Wq)`` and int32
        ``(B', Hk, N, Wk)`` (``W`` = the stack's last ``out_features // 32``).

    On CUDA both problems run in one launch of the fused encoder when each has at most 64 rows
    per head (``B * L`` and ``B' * N``: a decode step) and they share the input dtype and the
    weight dtype; otherwise each runs on its own path, with the same results. Errors name the
    argument (``query``, ``key_weights[1]``, ...).
    """
    return torch.ops.hashattention.encode_signatures_pair.default(
        query, list(query_weights), list(query_biases), key, list(key_weights), list(key_biases), activation
    )


@torch.library.register_fake("hashattention::encode_signatures_pair")
def _encode_signatures_pair_fake(query, query_weights, query_biases, key, key_weights, key_biases, activation="silu"):
    _check_same_device("query", query, query_weights=query_weights, query_biases=query_biases, key=key)
    _check_same_device("key", key, key_weights=key_weights, key_biases=key_biases)
    query_signatures = _encode_signatures_fake(query, query_weights, query_biases, activation)
    batch, _, tokens, _ = key.shape
    key_heads = key_weights[0].shape[0]  # the MLP heads, not key's (which may be fewer)
    key_signatures = key.new_empty((batch, key_heads, tokens, key_weights[-1].shape[-1] // 32), dtype=torch.int32)
    return query_signatures, key_signatures


def encode_signatures_pair_into(
    query: Tensor,
    query_weights: Sequence[Tensor],
    query_biases: Sequence[Tensor],
    key: Tensor,
    key_weights: Sequence[Tensor],
    key_biases: Sequence[Tensor],
    key_signatures: Tensor,
    positions: Tensor,
    activation: str = "silu",
) -> Tensor:
    """:func:`encode_signatures_pair` with the key signatures stored into a cache, in place.

    A decode step appends keys to a preallocated signature cache; storing them from the encoder
    itself saves a separate copy kernel per layer. Exactly::

        query_signatures, new = encode_signatures_pair(query, ..., key, ..., activation)
        key_signatures[:, :, positions] = new

    Args:
        query, query_weights, query_biases, key, key_weights, key_biases, activation: as in
            :func:`encode_signatures_pair`; ``key`` is ``(B', Hx, N, D')``.
        key_signatures: int32 ``(B', Hk, S, Wk)`` cache, written in place at the rows
            ``positions`` (any strides; every other row is left as it was).
        positions: int64 ``(N,)`` distinct cache slots in ``[0, S)``, one per key token (device
            values: CUDA-graph safe). On the CPU they are checked (``ValueError``); on CUDA a
            check would need a host sync, so a slot outside ``[0, S)`` is skipped.

    Returns:
        ``query_signatures``: int32 ``(B, Hq, L, Wq)``.

    Under ``torch.compile`` the cache stays in place (the op declares it mutated; no copy).
    """
    return torch.ops.hashattention.encode_signatures_pair_into.default(
        query, list(query_weights), list(query_biases), key, list(key_weights), list(key_biases), key_signatures,
        positions, activation,
    )


@torch.library.register_fake("hashattention::encode_signatures_pair_into")
def _encode_signatures_pair_into_fake(
    query, query_weights, query_biases, key, key_weights, key_biases, key_signatures, positions, activation="silu"
):
    _check_same_device("query", query, query_weights=query_weights, query_biases=query_biases, key=key)
    _check_same_device("key", key, key_weights=key_weights, key_biases=key_biases, key_signatures=key_signatures,
                       positions=positions)
    return _encode_signatures_fake(query, query_weights, query_biases, activation)


def pack_signs(values: Tensor) -> Tensor:
    """Pack signs computed elsewhere: float ``(..., bits)`` -> int32 ``(..., bits // 32)``.

    Bit ``j`` of word ``w`` is 1 iff ``values[..., 32 w + j] > 0`` (zero and NaN give 0).
    ``bits`` must be a positive multiple of 32.
    """
    return torch.ops.hashattention.pack_signs.default(values)


@torch.library.register_fake("hashattention::pack_signs")
def _pack_signs_fake(values):
    return values.new_empty((*values.shape[:-1], values.shape[-1] // 32), dtype=torch.int32)


def unpack_signs(words: Tensor) -> Tensor:
    """The inverse of :func:`pack_signs`: int32 ``(..., W)`` -> bool ``(..., 32 W)`` (plain torch, no op)."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int64)
    bits = (words.to(torch.int64)[..., None] >> shifts) & 1
    return bits.reshape(*words.shape[:-1], words.shape[-1] * 32).bool()


def hamming_scores(query_signatures: Tensor, key_signatures: Tensor, selection_heads: int) -> Tensor:
    """Hamming similarity of every query row to every key, for research and evaluation.

    Args:
        query_signatures: int32 ``(B, Hq, L, W)``.
        key_signatures: int32 ``(B, Hk, N, W)`` with ``Hk`` dividing ``Hq`` (``Hq``: per query
            head as in the paper; ``Hkv``: one signature per KV head).
        selection_heads: ``Hs``, dividing ``Hq``. ``Hs = Hq`` scores each query head alone;
            ``Hs < Hq`` sums the scores of the ``Hq // Hs`` query heads of each group.

    Returns:
        int32 ``(B, Hs, L, N)``: ``sum over the group's heads of (32 W - popcount(q XOR k))``,
        in ``[0, 32 W Hq / Hs]``; higher is more similar. No causal or length masking is
        applied. The decode path uses :func:`hamming_topk`, which never writes this tensor.
    """
    _check_schema_int("selection_heads", selection_heads, "a divisor of the query heads")
    return torch.ops.hashattention.hamming_scores.default(query_signatures, key_signatures, selection_heads)


@torch.library.register_fake("hashattention::hamming_scores")
def _hamming_scores_fake(query_signatures, key_signatures, selection_heads):
    _check_same_device("query_signatures", query_signatures, key_signatures=key_signatures)
    batch, _, rows, _ = query_signatures.shape
    keys = key_signatures.shape[2]
    return query_signatures.new_empty((batch, selection_heads, rows, keys), dtype=torch.int32)


def hamming_topk(
    query_signatures: Tensor,
    key_signatures: Tensor,
    *,
    selection_heads: int,
    sink_tokens: int,
    local_tokens: int,
    budget_tokens: int,
    lengths: Optional[Tensor] = None,
    start_positions: Optional[Tensor] = None,
    budgets: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Fused Hamming scoring and exact top-k selection with sink and local windows.

    For each (batch ``b``, selection head ``s``, query row ``l``) the row's position is
    ``p = lengths[b] - L + l`` and its selectable range is ``[start, p]`` with
    ``start = start_positions[b]``. It selects

    * the sink window ``[start, start + sink_tokens)``,
    * the local window: the latest ``local_tokens`` positions up to ``p``,
    * the ``m`` best remaining positions by :func:`hamming_scores` similarity, where
      ``m = min(budget_tokens, budgets[b])`` (``budgets`` values are clamped to
      ``[0, budget_tokens]``); ties go to the later position.

    Args:
        query_signatures: int32 ``(B, Hq, L, W)``.
        key_signatures: int32 ``(B, Hk, N, W)`` (``Hk`` divides ``Hq``); only the first
            ``lengths[b]`` keys of each sequence are read.
        selection_heads: ``Hs`` (``Hq`` or ``Hkv``; any divisor of ``Hq``).
        sink_tokens, local_tokens, budget_tokens: non-negative; their sum ``K`` is the fixed
            output width (``budget_tokens`` is static: it sets the output shape).
        lengths: int32 ``(B,)`` valid keys per sequence, in ``[0, N]``; default ``N``.
        start_positions: int32 ``(B,)`` left-padding offsets, in ``[0, lengths[b]]``;
            positions before it are never selected; default 0.
        budgets: int32 ``(B,)`` per-sequence heavy budget (clamped to ``[0, budget_tokens]``),
            e.g. computed on the device from the current length so CUDA graphs stay valid.

    Returns:
        ``(indices, counts)``: int32 ``(B, Hs, L, K)`` positions in ascending order, padded
        with -1 after the first ``counts[b, s, l]`` entries; int32 ``(B, Hs, L)`` counts.
        With ``budget_tokens >= N`` every causal, non-padding position is selected.
    """
    _check_selection_ints(selection_heads, sink_tokens, local_tokens, budget_tokens)
    return torch.ops.hashattention.hamming_topk.default(
        query_signatures,
        key_signatures,
        lengths,
        start_positions,
        budgets,
        selection_heads,
        sink_tokens,
        local_tokens,
        budget_tokens,
    )


@torch.library.register_fake("hashattention::hamming_topk")
def _hamming_topk_fake(
    query_signatures, key_signatures, lengths, start_positions, budgets, selection_heads, sink, local, budget
):
    _check_same_device("query_signatures", query_signatures, key_signatures=key_signatures, lengths=lengths,
                       start_positions=start_positions, budgets=budgets)
    batch, _, rows, _ = query_signatures.shape
    width = sink + local + budget
    indices = query_signatures.new_empty((batch, selection_heads, rows, width), dtype=torch.int32)
    counts = query_signatures.new_empty((batch, selection_heads, rows), dtype=torch.int32)
    return indices, counts


def encode_pair_and_select(
    query: Tensor,
    query_weights: Sequence[Tensor],
    query_biases: Sequence[Tensor],
    key: Tensor,
    key_weights: Sequence[Tensor],
    key_biases: Sequence[Tensor],
    key_signatures: Tensor,
    positions: Tensor,
    *,
    activation: str = "silu",
    selection_heads: int,
    sink_tokens: int,
    local_tokens: int,
    budget_tokens: int,
    lengths: Optional[Tensor] = None,
    start_positions: Optional[Tensor] = None,
    budgets: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """A decode step's selection from the query rows, with the new keys' signatures stored. Exactly::

        query_signatures = encode_signatures_pair_into(query, query_weights, query_biases, key, key_weights,
                                                       key_biases, key_signatures, positions, activation)
        indices, counts = hamming_topk(query_signatures, key_signatures, selection_heads=..., ...)

    One op for one step of the model: every device runs the two ops in turn, and their argument checks
    and errors apply. (A one-launch CUDA version, the selection computing the signatures itself, was
    measured no faster than the two launches and removed; ``csrc/encode_pair_and_select.cpp`` says
    where its results are.)

    Args:
        query, query_weights, query_biases, key, key_weights, key_biases, key_signatures, positions,
            activation: as in :func:`encode_signatures_pair_into` (``key_signatures`` is written in
            place at the rows ``positions``).
        selection_heads, sink_tokens, local_tokens, budget_tokens, lengths, start_positions, budgets:
            as in :func:`hamming_topk`, which reads ``key_signatures`` after the store.

    Returns:
        ``(indices, counts, query_signatures)``: int32 ``(B, Hs, L, K)``, ``(B, Hs, L)`` as from
        :func:`hamming_topk`, and the query signatures, int32 ``(B, Hq, L, Wq)``.
    """
    _check_selection_ints(selection_heads, sink_tokens, local_tokens, budget_tokens)
    return torch.ops.hashattention.encode_pair_and_select.default(
        query, list(query_weights), list(query_biases), key, list(key_weights), list(key_biases), key_signatures,
        positions, activation, selection_heads, sink_tokens, local_tokens, budget_tokens, lengths, start_positions,
        budgets,
    )


@torch.library.register_fake("hashattention::encode_pair_and_select")
def _encode_pair_and_select_fake(
    query, query_weights, query_biases, key, key_weights, key_biases, key_signatures, positions, activation,
    selection_heads, sink, local, budget, lengths=None, start_positions=None, budgets=None,
):
    _check_same_device("query", query, query_weights=query_weights, query_biases=query_biases, key=key,
                       lengths=lengths, start_positions=start_positions, budgets=budgets)
    _check_same_device("key", key, key_weights=key_weights, key_biases=key_biases, key_signatures=key_signatures,
                       positions=positions)
    query_signatures = _encode_signatures_fake(query, query_weights, query_biases, activation)
    indices, counts = _hamming_topk_fake(
        query_signatures, key_signatures, lengths, start_positions, budgets, selection_heads, sink, local, budget
    )
    return indices, counts, query_signatures


def topk_from_scores(
    scores: Tensor,
    *,
    sink_tokens: int,
    local_tokens: int,
    budget_tokens: int,
    lengths: Optional[Tensor] = None,
    start_positions: Optional[Tensor] = None,
    budgets: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """The selection contract of :func:`hamming_topk` applied to precomputed scores.

    Args:
        scores: ``(B, Hs, L, N)`` of any real dtype (floating or integer); higher is better.
            NaN ranks below every number. Any strides.
        Other arguments and the returned ``(indices, counts)`` are as in :func:`hamming_topk`.

    This is how other selectors (the exact top-k oracle, Quest, H2O, ...) share one budget
    contract and one attention op.
    """
    _check_selection_ints(None, sink_tokens, local_tokens, budget_tokens)
    return torch.ops.hashattention.topk_from_scores.default(
        scores, lengths, start_positions, budgets, sink_tokens, local_tokens, budget_tokens
    )


@torch.library.register_fake("hashattention::topk_from_scores")
def _topk_from_scores_fake(scores, lengths, start_positions, budgets, sink, local, budget):
    _check_same_device("scores", scores, lengths=lengths, start_positions=start_positions, budgets=budgets)
    batch, heads, rows, _ = scores.shape
    width = sink + local + budget
    indices = scores.new_empty((batch, heads, rows, width), dtype=torch.int32)
    counts = scores.new_empty((batch, heads, rows), dtype=torch.int32)
    return indices, counts


def sparse_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    indices: Tensor,
    counts: Optional[Tensor] = None,
    *,
    scale: float,
    block_table: Optional[Tensor] = None,
    workspace: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Exact softmax attention over the KV rows named by ``indices`` (paged attention, page size 1).

    Args:
        query: ``(B, Hq, L, D)`` float32/float16/bfloat16, ``D`` in (64, 128, 256); any strides
            with a contiguous last dimension.
        key_cache, value_cache: same dtype as ``query``. HF layout ``(B, Hkv, N, D)`` (any
            strides with a contiguous last dimension, read in place -- a slice of a
            preallocated static cache works without a copy), or, with ``block_table``, the
            paged layout ``(num_pages, page_size, Hkv, D)``.
        indices: int32 ``(B, Hs, L, K)`` positions; query head ``h`` uses list
            ``h // (Hq // Hs)``. A position ``p`` addresses row ``p`` of the HF cache, or
            slot ``p % page_size`` of page ``block_table[b, p // page_size]``.
        counts: int32 ``(B, Hs, L)``: only the first ``counts`` entries of each list are used.
            Without it every entry is used and negative entries are skipped.
        scale: multiplier of ``q . k`` (usually ``D ** -0.5``).
        block_table: int32 ``(B, max_pages)`` (vLLM's layout) for the paged cache.
        workspace: optional int32 tensor, contiguous, on the query's device, with at least
            ``B * Hq * L`` elements, **all zero** (e.g. ``torch.zeros(B * Hq * L,
            dtype=torch.int32, device=query.device)``, allocated once and reused; every call
            leaves it zero again). The CUDA kernel splits long lists over several blocks and
            merges them through one counter per (batch, head, row); with a workspace it uses
            these counters instead of zeroing new ones, which saves a memset kernel per call
            and lets the attention start while the kernel before it (the selection) finishes.
            Calls that share a workspace must not run at the same time (on other streams).
            The CPU kernel checks it and needs none.

    Returns:
        ``(out, lse)``: ``(B, Hq, L, D)`` in the query dtype -- softmax over the selected rows
        only, accumulated in float32 -- and the float32 ``(B, Hq, L)`` natural-log
        log-sum-exp of the scaled logits, so results can be merged with other attention.
        A row with no selected positions gets ``out = 0`` and ``lse = -inf``. NaN and infinite
        inputs give what dense attention (SDPA's math backend, ``torch.logsumexp``) gives: a NaN in
        the query, the scale or a selected key row makes ``out`` and ``lse`` NaN, a ``+inf`` logit
        makes ``out`` NaN and ``lse`` ``+inf``, a non-finite selected value shows in ``out``, and a
        row whose logits are all ``-inf`` gets ``out = 0``, ``lse = -inf`` (docs/ops.md).
    """
    return torch.ops.hashattention.sparse_attention.default(
        query, key_cache, value_cache, indices, counts, block_table, float(scale), workspace
    )


@torch.library.register_fake("hashattention::sparse_attention")
def _sparse_attention_fake(query, key_cache, value_cache, indices, counts, block_table, scale, workspace=None):
    _check_same_device("query", query, key_cache=key_cache, value_cache=value_cache, indices=indices, counts=counts,
                       block_table=block_table, workspace=workspace)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    lse = query.new_empty(query.shape[:-1], dtype=torch.float32)
    return out, lse
