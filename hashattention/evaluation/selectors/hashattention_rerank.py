"""HashAttention candidates re-ranked by their exact scores (an experiment).

The learned signatures rank every cached key cheaply but coarsely: 33 Hamming values for 8K keys,
so the budget's threshold falls inside a large tie, and the evaluation's lost answers are keys the
exact top-k keeps and the signatures do not. ``hashattention-rerank-<c>`` keeps plain HashAttention
per query head as a first stage with ``c * m`` heavy tokens (the windows as usual), then reads the
keys of those candidates, computes their exact logits ``q . k / sqrt(d)`` and keeps the ``m`` best:
the same budget contract and sparse attention as every selector, the same 32-bit key signatures
(no extra memory per token).

What it costs is bytes read, not memory: a decode step reads the keys of ``c * m`` candidates plus
the keys and values of the ``m`` kept, ``(c + 2) * m`` rows of ``D`` instead of ``2 * m`` -- at
``c = 2`` twice the sparse attention's reads at the same ``m``, or the same reads as plain
HashAttention at half the sparsity. The report compares it at equal ``m``; compare it at equal
bytes by running it at twice the sparsity.
"""

from __future__ import annotations

import dataclasses

from ... import ops
from ..metrics import selection_mask
from .base import grouped_logits
from .hashattention_selector import HashAttentionSelector


class RerankedHashAttention(HashAttentionSelector):
    name = "hashattention-rerank"
    variants = {"-2": {"candidate_factor": 2}, "-4": {"candidate_factor": 4}}

    def __init__(self, candidate_factor: int = 2):
        super().__init__(selection="query")
        if not isinstance(candidate_factor, int) or candidate_factor < 1:
            raise ValueError(f"candidate_factor must be a positive int, got {candidate_factor!r}")
        self.candidate_factor = candidate_factor

    def identity(self):
        return {**super().identity(), "candidate_factor": self.candidate_factor}

    def select(self, layer, query, key, value, budget, scaling):
        # Stage 1: plain HashAttention with c * m heavy tokens.
        wider = dataclasses.replace(budget, heavy_tokens=budget.heavy_tokens * self.candidate_factor)
        indices, counts = super().select(layer, query, key, value, wider, scaling)
        candidates = selection_mask(indices, counts, key.shape[2], query.shape[1])  # (B, Hq, P, N)
        logits = grouped_logits(query, key, scaling)
        # Non-candidates rank below every candidate; the windows are kept by the selection itself.
        scores = logits.masked_fill(~candidates, float("-inf"))
        return ops.topk_from_scores(scores, sink_tokens=budget.sink_tokens, local_tokens=budget.local_tokens,
                                    budget_tokens=budget.heavy_tokens)

