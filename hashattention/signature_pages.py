"""Key-signature pages beside transformers' ``PagedAttentionCache``: same slots, same block ids.

Each sparse layer gets one int32 tensor ``(num_slots, Hk, W)``, ``num_slots`` the K/V cache's
(``(num_blocks + 2) * block_size``, the two padding blocks included), so a token's signatures sit
at the slot its key and value sit at: the cache manager's block allocation, freeing and prefix
sharing cover them without any bookkeeping of their own. Viewed as ``(num_blocks + 2, block_size,
Hk, W)`` they are the K/V pages' layout.

Written once per token, at the slots of ``write_index``, in the same attention call that writes
its key and value (:func:`write`), before anything reads them; so a block freed by a finished
request and handed to a new one holds the new request's signatures at every position the new
request reads (positions below its length were all written by it). Blocks copied for a forked
request (``num_return_sequences > 1``) are copied here too (the cache's ``copy_cache`` is wrapped).

Bytes per token and layer: ``Hk * W * 4`` (``Hk``: the query heads with per-query-head key MLPs,
the KV heads with ``key_heads="kv"``), beside ``2 * Hkv * D * itemsize`` of K/V.
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

from .adapters import LayerAdapter

_ATTRIBUTE = "_hashattention_signature_pages"


class SignaturePages:
    """The signature pages of one ``PagedAttentionCache``, one tensor per sparse layer."""

    def __init__(self, cache):
        self.cache = cache
        self.num_slots = cache.cache_shape[0]
        self.block_size = cache.block_size
        self.layers: Dict[int, Tensor] = {}
        self.adapters: Dict[int, LayerAdapter] = {}

    def layer(self, layer_idx: int, adapter: LayerAdapter) -> Tensor:
        """int32 ``(num_slots, Hk, W)`` pages of ``layer_idx``, allocated (zeroed) on first use."""
        pages = self.layers.get(layer_idx)
        if pages is None:
            config = adapter.config
            pages = torch.zeros((self.num_slots, config.num_key_signature_heads, config.words), dtype=torch.int32,
                                device=self.cache.key_cache[0].device)
            self.layers[layer_idx] = pages
            self.adapters[layer_idx] = adapter
        elif self.adapters[layer_idx] is not adapter:
            # Prefix sharing hands finished requests' blocks to new ones without recomputing them.
            raise ValueError(
                f"the continuous batching cache's signature pages of layer {layer_idx} were written under other "
                "adapters; call model.destroy_cached_continuous_batching_manager() after patching with new adapters"
            )
        return pages

    def copy_blocks(self, source_blocks, forked_blocks) -> None:
        """Copy the pages of ``source_blocks`` into ``forked_blocks`` (lists of block ids), every layer."""
        if not self.layers:
            return
        device = next(iter(self.layers.values())).device
        source = torch.tensor(list(source_blocks), device=device, dtype=torch.int64)
        forked = torch.tensor(list(forked_blocks), device=device, dtype=torch.int64)
        for pages in self.layers.values():
            blocks = pages.view(-1, self.block_size, *pages.shape[1:])
            blocks[forked] = blocks[source]


def signature_pages(cache) -> SignaturePages:
    """The :class:`SignaturePages` of ``cache`` (a ``PagedAttentionCache``), created on first use.

    Creating them wraps the cache's ``copy_cache`` (forks) so the signatures follow the K/V copy.
    """
    pages = cache.__dict__.get(_ATTRIBUTE)
    if pages is None:
        pages = SignaturePages(cache)
        copy_kv = cache.copy_cache

        def copy_cache(source_blocks, forked_blocks):
            copy_kv(source_blocks, forked_blocks)
            pages.copy_blocks(source_blocks, forked_blocks)

        cache.copy_cache = copy_cache
        setattr(cache, _ATTRIBUTE, pages)
    return pages


def write(pages: Tensor, adapter: LayerAdapter, key: Tensor, write_index: Tensor) -> None:
    """Encode the batch's new keys and store their signatures at their K/V slots.

    Args:
        pages: int32 ``(num_slots, Hk, W)`` from :meth:`SignaturePages.layer`.
        adapter: the layer's adapter.
        key: post-RoPE new keys ``(1, Hkv, T, D)`` of the packed batch.
        write_index: int64 ``(T,)`` their slots (padding rows may share the cache's trash slot,
            so this is a plain ``index_copy_``, which allows repeated slots).
    """
    signatures = adapter.key_signatures(key)[0].transpose(0, 1)  # (T, Hk, W)
    pages.index_copy_(0, write_index, signatures)


def gather(pages: Tensor, slots: Tensor) -> Tensor:
    """int32 ``(R, Hk, N, W)`` signatures of each request's positions (``slots`` int64 ``(R, N)``).

    :func:`hashattention.ops.hamming_topk` takes one dense ``(B, Hk, N, W)`` tensor, so the
    signatures (not the K/V) of each request are gathered: ``Hk * W * 4`` bytes per key.
    """
    return pages[slots].permute(0, 2, 1, 3)
