"""``"paged|hashattention"``: HashAttention inside transformers' continuous batching.

transformers' continuous batching calls the registered function from every attention layer with
the packed batch (:mod:`hashattention.paged_layout` describes the arguments): query ``(1, Hq, T,
D)`` and the new keys / values ``(1, Hkv, T, D)`` of ``T`` packed rows, the ``PagedAttentionCache``
(``cache``), ``cu_seq_lens_q`` / ``cu_seq_lens_k``, ``max_seqlen_q`` / ``max_seqlen_k`` (host ints),
``read_index`` / ``write_index`` (one tensor per layer group) and ``logits_indices``; no attention
mask (it builds masks only for ``paged|sdpa`` and ``paged|eager``) and no block table (its decode
fast path is for flash attention only). One call:

1. writes the new keys and values at ``write_index`` and their key signatures at the same slots
   (:mod:`hashattention.signature_pages`);
2. when some request brings more than one row (a prompt chunk), runs every row dense, as
   ``paged|sdpa`` does: the cache's gather of each request's K/V and SDPA under a block-diagonal
   causal mask built here from the offsets;
3. runs the sparse rows -- each decode row and the last ``sparse_prompt_tokens`` rows of a prompt's
   final chunk -- through :func:`hashattention.ops.hamming_topk` over the request's signatures and
   :func:`hashattention.ops.sparse_attention` over the K/V pages in place (block table), and
   writes their outputs over the dense ones.

A batch of decode rows only (``max_seqlen_q == 1``) skips step 2: it gathers no K/V, only the
requests' signatures (``Hk * W * 4`` bytes per key, for the selection op's dense layout). Nothing
reads a device value back to the host.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from transformers.modeling_utils import AttentionInterface

from . import ops, paged_layout, signature_pages
from .attention import LayerRuntime, selection_arguments

PAGED_ATTENTION_NAME = "paged|hashattention"


def _per_layer_type(value, name: str):
    """``cu_seq_lens_k`` / ``max_seqlen_k`` are dicts by layer type on models with several (sliding
    windows, which a patched model has not); the full-attention entry is this layer's."""
    if isinstance(value, dict):
        if "full_attention" not in value:
            raise ValueError(f"{PAGED_ATTENTION_NAME} needs full-attention layers, got {name} for {sorted(value)}")
        return value["full_attention"]
    return value


def _dense_rows(query: Tensor, keys: Tensor, values: Tensor, cu_seq_lens_q: Tensor, cu_seq_lens_k: Tensor,
                scaling: float) -> Tensor:
    """SDPA of every packed row over its own request's keys: ``(T, Hq, D)``.

    ``keys`` / ``values``: ``(K, Hkv, D)``, each request's keys in ``read_index`` order.
    """
    rows, total_keys = query.shape[2], keys.shape[0]
    mask = paged_layout.packed_causal_mask(cu_seq_lens_q, cu_seq_lens_k, rows, total_keys)
    key = keys.transpose(0, 1).unsqueeze(0)
    value = values.transpose(0, 1).unsqueeze(0)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out[0].transpose(0, 1)


def _sparse_rows(runtime: LayerRuntime, query: Tensor, key_pages: Tensor, value_pages: Tensor, pages: Tensor,
                 slots: Tensor, cu_seq_lens_q: Tensor, cu_seq_lens_k: Tensor, max_rows: int, max_keys: int,
                 block_size: int, logits_indices: Optional[Tensor], scaling: float) -> Tuple[Tensor, Tensor, Tensor]:
    """Selection and attention of the sparse rows.

    Returns ``(out, rows, valid)``: ``(R, L, Hq, D)`` outputs, their packed row indices int64
    ``(R, L)`` and bool ``(R, L)`` (False: a padding row of a request with fewer sparse rows).
    """
    config = runtime.config
    total_rows = query.shape[2]
    rows_per_request = 1 if max_rows <= 1 else max(1, min(config.sparse_prompt_tokens, max_rows))
    rows, valid = paged_layout.sparse_rows(
        cu_seq_lens_q, rows_per_request, total_rows, config.sparse_prompt_tokens,
        paged_layout.final_chunks(cu_seq_lens_q, logits_indices),
    )
    sparse_query = query[0][:, rows].transpose(0, 1)  # (R, Hq, L, D)
    table = paged_layout.block_table(slots, cu_seq_lens_k, block_size, max_keys)
    key_signatures = signature_pages.gather(pages, paged_layout.position_slots(table, block_size, max_keys))
    lengths = paged_layout.request_lengths(cu_seq_lens_k)
    starts = torch.zeros_like(lengths)  # no left padding in a packed batch
    indices, counts = ops.hamming_topk(
        runtime.adapter.query_signatures(sparse_query), key_signatures,
        **selection_arguments(runtime, max_keys, lengths, starts, None),
    )
    out, _ = ops.sparse_attention(sparse_query, key_pages, value_pages, indices, counts, scale=scaling,
                                  block_table=table)
    return out.transpose(1, 2), rows, valid


def paged_hashattention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
) -> Tuple[Tensor, None]:
    """transformers paged attention function: ``(out (1, T, Hq, D), None)`` for the packed batch.

    Args:
        module: the attention module (``layer_idx``).
        query: post-RoPE ``(1, Hq, T, D)``; key, value: the new ``(1, Hkv, T, D)``.
        attention_mask: ignored (None under continuous batching for this implementation).
        kwargs: transformers' paged arguments (see the module docstring) and the ``hashattention``
            :class:`~hashattention.attention.LayerRuntime` that :func:`hashattention.patch` adds.
    """
    runtime: Optional[LayerRuntime] = kwargs.pop("hashattention", None)
    kwargs.pop("hashattention_cache_layer", None)
    kwargs.pop("hashattention_start_layer", None)
    cache = kwargs.get("cache")
    if runtime is None:
        raise ValueError(
            f"{PAGED_ATTENTION_NAME} runs on a model patched with hashattention.patch(model, adapters, config); "
            f"this {type(module).__name__} has no HashAttention state"
        )
    if cache is None:
        raise ValueError(
            f"{PAGED_ATTENTION_NAME} was called without a paged attention cache: it runs under continuous batching "
            "(generate_batch, init_continuous_batching); a patched model's forward and generate use 'hashattention'"
        )
    if kwargs.get("block_table") is not None:
        raise ValueError(f"{PAGED_ATTENTION_NAME} reads the cache through read_index; got a decode block table")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5

    group, index_in_group = cache.layer_index_to_group_indices[module.layer_idx]
    read_index, write_index = kwargs["read_index"][group], kwargs["write_index"][group]
    cu_seq_lens_q = kwargs["cu_seq_lens_q"]
    cu_seq_lens_k = _per_layer_type(kwargs["cu_seq_lens_k"], "cu_seq_lens_k")
    max_rows = int(kwargs["max_seqlen_q"])
    max_keys = int(_per_layer_type(kwargs["max_seqlen_k"], "max_seqlen_k"))
    key_cache, value_cache = cache.key_cache[index_in_group], cache.value_cache[index_in_group]
    total_rows, heads, head_dim = query.shape[2], query.shape[1], query.shape[3]

    if not runtime.dense:  # the signatures land with their keys, before any read
        pages = signature_pages.signature_pages(cache).layer(module.layer_idx, runtime.adapter)
        signature_pages.write(pages, runtime.adapter, key, write_index)

    if runtime.dense or max_rows > 1:
        keys, values = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                    read_index=kwargs["read_index"], write_index=kwargs["write_index"])
        out = _dense_rows(query, keys, values, cu_seq_lens_q, cu_seq_lens_k, scaling)
        if runtime.dense:
            return out.unsqueeze(0), None
    else:  # decode rows only: write the K/V, read nothing back densely
        key_cache.index_copy_(0, write_index, key[0].transpose(0, 1))
        value_cache.index_copy_(0, write_index, value[0].transpose(0, 1))
        out = query.new_zeros((total_rows, heads, head_dim))

    block_size = cache.block_size
    kv_heads = key_cache.shape[1]
    sparse_out, rows, valid = _sparse_rows(
        runtime, query, key_cache.view(-1, block_size, kv_heads, head_dim),
        value_cache.view(-1, block_size, kv_heads, head_dim), pages,
        paged_layout.request_slots(read_index, write_index), cu_seq_lens_q, cu_seq_lens_k, max_rows, max_keys,
        block_size, kwargs.get("logits_indices"), scaling,
    )
    # Padding rows of the (R, L) layout go to one extra row, dropped after the copy.
    destination = torch.where(valid, rows, total_rows).flatten()
    out = torch.cat([out, out.new_zeros((1, heads, head_dim))])
    out.index_copy_(0, destination, sparse_out.reshape(-1, heads, head_dim).to(out.dtype))
    return out[:total_rows].unsqueeze(0), None


def register() -> None:
    """Register ``"paged|hashattention"`` with transformers' ``AttentionInterface`` (idempotent).

    No mask function is registered on purpose: transformers then builds no mask for it (the
    packed batch's block-diagonal mask is built here, from the offsets, only when dense rows
    need it).
    """
    AttentionInterface.register(PAGED_ATTENTION_NAME, paged_hashattention_forward)
