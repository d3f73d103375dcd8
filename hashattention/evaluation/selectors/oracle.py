"""Exact top-k oracle: the true scores ``q . k / sqrt(d)`` of each query head (an upper bound, not a method)."""

from __future__ import annotations

from .base import Selector, grouped_logits


class ExactTopK(Selector):
    name = "oracle"

    def aux_bits_per_token(self, shape):
        return None  # reads every key in full: not a compressed index

    def scores(self, layer, query, key, scaling):
        return grouped_logits(query, key, scaling)
