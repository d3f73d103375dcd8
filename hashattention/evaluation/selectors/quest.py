"""Quest (Tang et al., 2024): query-aware page selection from per-page key bounds.

Keys are grouped into pages of ``page_size`` consecutive positions; each page keeps the
element-wise minimum and maximum of its keys (per KV head). A page's score for a query is the
upper bound ``sum_d max(q_d * min_d, q_d * max_d)`` of ``q . k`` over any key inside it, and
every token of the page gets its page's score, so the shared top-m picks whole pages (ties go
to later positions, so only the lowest-ranked page can be partially taken). Per query head.
The last page holds only the keys cached so far, as in decoding.
"""

from __future__ import annotations

import torch

from .base import Selector, repeat_kv_heads


def page_bounds(key, page_size: int):
    """``(min, max)`` of each page of keys: ``(B, Hkv, ceil(N / page_size), D)`` each."""
    batch, heads, keys, dim = key.shape
    pad = (-keys) % page_size
    if pad:  # repeat the last key: it changes neither the minimum nor the maximum of its page
        key = torch.cat([key, key[:, :, -1:].expand(batch, heads, pad, dim)], dim=2)
    pages = key.float().view(batch, heads, -1, page_size, dim)
    return pages.amin(dim=3), pages.amax(dim=3)


class Quest(Selector):
    name = "quest"
    sequential_rows = True  # the page holding a row's position must not see later keys

    def __init__(self, page_size: int = 16):
        super().__init__()
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size

    def aux_bits_per_token(self, shape):
        # fp16 min and max of every channel, per page of page_size tokens, per KV head
        return 2 * shape.head_dim * 16 / self.page_size * shape.num_kv_heads

    def scores(self, layer, query, key, scaling):
        group = query.shape[1] // key.shape[1]
        low, high = page_bounds(key, self.page_size)
        low, high = repeat_kv_heads(low, group), repeat_kv_heads(high, group)
        q = query.float()[:, :, :, None, :]  # (B, Hq, P, 1, D) against (B, Hq, 1, pages, D)
        bound = torch.maximum(q * low[:, :, None], q * high[:, :, None]).sum(dim=-1)
        return bound.repeat_interleave(self.page_size, dim=-1)[..., : key.shape[2]]
