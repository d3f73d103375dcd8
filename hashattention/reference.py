"""Plain-PyTorch versions of every ``torch.ops.hashattention`` op: the oracle of the tests.

Written for clarity, not speed: vectorised where it is easy, float64 wherever rounding
matters, and no shared code with the C++/CUDA kernels. Each function takes the same
arguments as its op in :mod:`hashattention.ops` (see there for shapes and semantics);
the selection functions return exactly what the ops must return, the attention
functions return float64 so the tests can compare each dtype at its own tolerance.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

# The oracle's own table (the library's is hashattention/activations.py): it shares no code with the library.
ACTIVATION_FUNCTIONS = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,  # exact (erf) GELU, as torch.nn.GELU() by default
    "tanh": torch.tanh,
    "identity": lambda h: h,
}


def mlp_outputs(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor], activation: str = "silu") -> Tensor:
    """The per-head MLP in float64: ``(B, H, N, D)`` -> pre-sign values ``(B, H, N, bits)``."""
    h = x.double()
    for i, (w, b) in enumerate(zip(weights, biases)):
        h = torch.einsum("bhni,hio->bhno", h, w.double()) + b.double()[None, :, None, :]
        if i + 1 < len(weights):
            h = ACTIVATION_FUNCTIONS[activation](h)
    return h


def pack_signs(values: Tensor) -> Tensor:
    """``(..., bits)`` -> int32 ``(..., bits // 32)``; bit ``j`` of word ``w`` = ``values[..., 32w + j] > 0``."""
    bits = values.shape[-1]
    signs = (values > 0).to(torch.int64).reshape(*values.shape[:-1], bits // 32, 32)
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64, device=values.device)
    words = (signs * weights).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement into int32
    return words.to(torch.int32)


def unpack_signs(words: Tensor) -> Tensor:
    """int32 ``(..., W)`` -> bool ``(..., 32 W)``, the inverse of :func:`pack_signs`."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int64)
    bits = (words.to(torch.int64)[..., None] >> shifts) & 1
    return bits.reshape(*words.shape[:-1], words.shape[-1] * 32).bool()


def encode_signatures(
    x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor], activation: str = "silu"
) -> Tensor:
    """Per-head MLP in float64, then :func:`pack_signs`."""
    return pack_signs(mlp_outputs(x, weights, biases, activation))


def encode_signatures_pair(
    query: Tensor,
    query_weights: Sequence[Tensor],
    query_biases: Sequence[Tensor],
    key: Tensor,
    key_weights: Sequence[Tensor],
    key_biases: Sequence[Tensor],
    activation: str = "silu",
) -> Tuple[Tensor, Tensor]:
    """Two float64 :func:`encode_signatures`; key head ``h`` of the key stack reads ``key`` head ``h // (Hk // Hx)``."""
    key_heads = key_weights[0].shape[0]
    expanded = key.repeat_interleave(key_heads // key.shape[1], dim=1)
    return (
        encode_signatures(query, query_weights, query_biases, activation),
        encode_signatures(expanded, key_weights, key_biases, activation),
    )


def hamming_scores(query_signatures: Tensor, key_signatures: Tensor, selection_heads: int) -> Tensor:
    """int32 ``(B, Hs, L, N)``: per query head ``bits - hamming distance``, summed over each group."""
    batch, query_heads, rows, words = query_signatures.shape
    key_heads, keys = key_signatures.shape[1], key_signatures.shape[2]
    bits = 32 * words
    q = unpack_signs(query_signatures).to(torch.int64)  # (B, Hq, L, bits)
    k = unpack_signs(key_signatures).to(torch.int64)  # (B, Hk, N, bits)
    k = k.repeat_interleave(query_heads // key_heads, dim=1)  # key head of each query head
    # Hamming distance = #(q=1,k=0) + #(q=0,k=1) = sum q + sum k - 2 q.k
    distance = q.sum(-1)[..., None] + k.sum(-1)[:, :, None, :] - 2 * torch.einsum("bhlc,bhnc->bhln", q, k)
    per_head = bits - distance  # (B, Hq, L, N)
    group = query_heads // selection_heads
    return per_head.reshape(batch, selection_heads, group, rows, keys).sum(2).to(torch.int32)


def row_windows(
    batch: int,
    rows: int,
    keys: int,
    sink_tokens: int,
    local_tokens: int,
    budget_tokens: int,
    lengths: Optional[Tensor] = None,
    start_positions: Optional[Tensor] = None,
    budgets: Optional[Tensor] = None,
    device=None,
):
    """Window bounds of every (batch, row): dict of int64 ``(B, L)`` tensors.

    ``start``, ``sink_end``, ``local_begin``, ``end`` and ``heavy``: the sink window is
    ``[start, sink_end)``, heavy candidates ``[sink_end, local_begin)`` of which ``heavy`` are
    taken, the local window ``[local_begin, end)``.
    """
    lengths = torch.full((batch,), keys) if lengths is None else lengths.cpu()
    start_positions = torch.zeros(batch) if start_positions is None else start_positions.cpu()
    budget = torch.full((batch,), budget_tokens) if budgets is None else budgets.cpu().clamp(0, budget_tokens)
    lengths = lengths.to(torch.int64).clamp(0, keys)[:, None]
    start = start_positions.to(torch.int64).clamp(min=0)[:, None].expand(batch, rows)
    end = lengths - rows + torch.arange(rows)[None, :] + 1
    empty = end <= start
    end = torch.where(empty, start, end)
    sink_end = torch.minimum(start + sink_tokens, end)
    local_begin = torch.maximum(end - local_tokens, sink_end)
    heavy = torch.minimum(budget.to(torch.int64)[:, None], local_begin - sink_end)
    heavy = torch.where(empty, torch.zeros_like(heavy), heavy)
    out = dict(start=start, sink_end=sink_end, local_begin=local_begin, end=end, heavy=heavy)
    return {name: t.to(device) for name, t in out.items()}


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
    """Reference selection: sink + local windows + the best ``m`` candidates.

    Ranking: higher score first, NaN last, ties to the later position. Implemented as
    stable sorts from the least to the most significant key.
    """
    batch, heads, rows, keys = scores.shape
    device = scores.device
    w = row_windows(
        batch, rows, keys, sink_tokens, local_tokens, budget_tokens, lengths, start_positions, budgets, device
    )
    expand = lambda t: t[:, None, :, None]  # (B, L) -> (B, 1, L, 1)  # noqa: E731
    position = torch.arange(keys, device=device)[None, None, None, :]
    candidate = (position >= expand(w["sink_end"])) & (position < expand(w["local_begin"]))
    candidate = candidate.expand(batch, heads, rows, keys)

    values = scores.to(torch.float64) if scores.is_floating_point() else scores.to(torch.int64)
    nan = torch.isnan(values) if scores.is_floating_point() else torch.zeros_like(candidate)
    lowest = float("-inf") if scores.is_floating_point() else torch.iinfo(torch.int64).min
    values = values.masked_fill(nan, lowest)

    order = torch.arange(keys, device=device).flip(0).expand(batch, heads, rows, keys)  # later first
    for key, descending in ((values, True), (nan.to(torch.int8), False), (candidate.to(torch.int8), True)):
        _, perm = torch.sort(key.gather(-1, order), dim=-1, descending=descending, stable=True)
        order = order.gather(-1, perm)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(keys, device=device).expand_as(order))
    heavy = candidate & (rank < expand(w["heavy"]))
    sink = (position >= expand(w["start"])) & (position < expand(w["sink_end"]))
    local = (position >= expand(w["local_begin"])) & (position < expand(w["end"]))
    selected = heavy | sink | local

    width = sink_tokens + local_tokens + budget_tokens
    counts = selected.sum(-1).to(torch.int32)
    sentinel = keys + width + 1
    ranked = torch.where(selected, position.expand_as(selected), torch.full_like(order, sentinel))
    ranked = ranked.sort(dim=-1).values
    if ranked.shape[-1] < width:
        pad = torch.full((batch, heads, rows, width - keys), sentinel, dtype=ranked.dtype, device=device)
        ranked = torch.cat([ranked, pad], dim=-1)
    indices = ranked[..., :width]
    indices = torch.where(indices == sentinel, torch.full_like(indices, -1), indices).to(torch.int32)
    return indices, counts


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
    """:func:`hamming_scores` followed by :func:`topk_from_scores`."""
    scores = hamming_scores(query_signatures, key_signatures, selection_heads)
    return topk_from_scores(
        scores,
        sink_tokens=sink_tokens,
        local_tokens=local_tokens,
        budget_tokens=budget_tokens,
        lengths=lengths,
        start_positions=start_positions,
        budgets=budgets,
    )


def gather_cache_rows(cache: Tensor, batch_index: int, kv_head: int, positions: Tensor, block_table=None) -> Tensor:
    """Rows ``positions`` of one (sequence, KV head) of an HF-layout or paged cache."""
    if block_table is None:
        return cache[batch_index, kv_head, positions.long()]
    page_size = cache.shape[1]
    pages = block_table[batch_index, (positions // page_size).long()].long()
    return cache[pages, (positions % page_size).long(), kv_head]


def dense_softmax(logits: Tensor, dim: int = -1) -> Tensor:
    """``torch.softmax``, except that a row whose logits are all -inf gets weights 0, not NaN.

    This is the softmax of PyTorch's math SDPA backend (``torch.ops.aten._safe_softmax``): a fully
    masked row gives ``out = 0``. Non-finite logits otherwise act as in ``torch.softmax``: a NaN or
    a +inf logit makes the row NaN.
    """
    weights = torch.softmax(logits, dim=dim)
    masked = (logits == float("-inf")).all(dim=dim, keepdim=True)
    return weights.masked_fill(masked, 0.0)


def sparse_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    indices: Tensor,
    counts: Optional[Tensor] = None,
    *,
    scale: float,
    block_table: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Attention over the indexed rows in float64. Returns float64 ``(out, lse)``.

    ``out = dense_softmax(logits) @ v`` and ``lse = torch.logsumexp(logits)`` with
    ``logits = k @ (q * scale)`` (the scale folded into the query, as the kernels do), so
    non-finite inputs give what dense attention gives: a NaN or +inf logit makes ``out`` NaN
    (``lse`` NaN or +inf), a non-finite selected value row shows in ``out``, and a row whose logits
    are all -inf gives ``out = 0``, ``lse = -inf``, as does a row with nothing selected.
    """
    batch, query_heads, rows, head_dim = query.shape
    selection_heads = indices.shape[1]
    kv_heads = key_cache.shape[2] if block_table is not None else key_cache.shape[1]
    out = torch.zeros(batch, query_heads, rows, head_dim, dtype=torch.float64, device=query.device)
    lse = torch.full((batch, query_heads, rows), float("-inf"), dtype=torch.float64, device=query.device)
    for b in range(batch):
        for h in range(query_heads):
            s, kv = h // (query_heads // selection_heads), h // (query_heads // kv_heads)
            for l in range(rows):
                positions = indices[b, s, l]
                positions = positions[: int(counts[b, s, l])] if counts is not None else positions[positions >= 0]
                if positions.numel() == 0:
                    continue
                k = gather_cache_rows(key_cache, b, kv, positions, block_table).double()
                v = gather_cache_rows(value_cache, b, kv, positions, block_table).double()
                logits = k @ (query[b, h, l].double() * scale)
                out[b, h, l] = dense_softmax(logits, dim=0) @ v
                lse[b, h, l] = torch.logsumexp(logits, dim=0)
    return out, lse


def dense_causal_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scale: float,
    lengths: Optional[Tensor] = None,
    start_positions: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Dense causal attention in float64 over an HF-layout cache ``(B, Hkv, N, D)``.

    Row ``l`` of ``L`` attends to positions ``[start, lengths[b] - L + l]``; returns float64
    ``(out, lse)`` with ``out = 0`` and ``lse = -inf`` for rows that see nothing; non-finite inputs
    act as in :func:`sparse_attention`.
    """
    batch, query_heads, rows, _ = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    w = row_windows(batch, rows, keys, 0, 0, 0, lengths, start_positions, None, query.device)
    k = key.double().repeat_interleave(query_heads // kv_heads, dim=1)
    v = value.double().repeat_interleave(query_heads // kv_heads, dim=1)
    logits = torch.einsum("bhld,bhnd->bhln", query.double() * scale, k)
    position = torch.arange(keys, device=query.device)[None, None, None, :]
    visible = (position >= w["start"][:, None, :, None]) & (position < w["end"][:, None, :, None])
    logits = logits.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    return dense_softmax(logits) @ v, lse
