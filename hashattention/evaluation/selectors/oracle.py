"""Exact top-k oracle: the true scores ``q . k / sqrt(d)`` of each query head (an upper bound, not a method)."""

from __future__ import annotations

import torch

from .base import Selector, repeat_kv_heads


class ExactTopK(Selector):
    name = "oracle"

    def aux_bits_per_token(self, shape):
        return None  # reads every key in full: not a compressed index

    def scores(self, layer, query, key, scaling):
        keys = repeat_kv_heads(key, query.shape[1] // key.shape[1])
        return torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scaling
