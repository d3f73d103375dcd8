"""The full model: every causal position, through dense SDPA. The reference row of every table."""

from __future__ import annotations

import torch

from ... import ops
from .base import Budget, Selector


class FullAttention(Selector):
    name = "full"
    dense = True

    def select(self, layer, query, key, value, budget: Budget, scaling):
        # Only used by the metrics and tests: the hook runs dense rows through SDPA instead.
        keys = key.shape[2]
        scores = torch.zeros(query.shape[0], query.shape[1], query.shape[2], keys, dtype=torch.int8)
        return ops.topk_from_scores(scores, sink_tokens=0, local_tokens=0, budget_tokens=keys)
