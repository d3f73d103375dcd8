"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention.

A key's score is the sum of the attention probabilities every earlier query row of the same
head gave it -- dense probabilities for the prefill rows, and, once decoding is sparse, the
probabilities the sparse attention actually computed over the selected rows (unselected keys
receive nothing, as if evicted). Because the scores only grow, a key that drops out of the
top-m can never overtake the kept ones again: top-m by accumulated score reproduces H2O's
greedy eviction (kept set = sink + recent window + heavy hitters) without deleting K/V rows.
Selection is per query head. The hook feeds sparse rows one at a time (``sequential_rows``),
so each row sees the attention of the rows before it.

The H2O paper splits its cache between the most recent tokens and the heavy hitters, half
each: ``h2o`` gives ``recent_fraction = 0.5`` of the heavy budget ``m`` to the positions right
before the local window (scored +inf, and the shared top-m breaks ties towards later
positions) and the rest to the accumulated scores; ``h2o-heavy-only`` gives all ``m`` to the
accumulated scores.
"""

from __future__ import annotations

import torch

from ... import ops
from .base import Selector, grouped_logits, repeat_kv_heads

_ROW_CHUNK = 256  # dense prefill rows per softmax block (bounds the (B, Hq, rows, N) temporary)


class HeavyHitterOracle(Selector):
    name = "h2o"
    variants = {"": {"recent_fraction": 0.5}, "-heavy-only": {"recent_fraction": 0.0}}
    sequential_rows = True

    def __init__(self, recent_fraction: float = 0.5):
        super().__init__()
        if not 0.0 <= recent_fraction <= 1.0:
            raise ValueError(f"recent_fraction must be in [0, 1], got {recent_fraction}")
        self.recent_fraction = recent_fraction

    def identity(self):
        return {**super().identity(), "recent_fraction": self.recent_fraction}

    def aux_bits_per_token(self, shape):
        return 32.0 * shape.num_query_heads  # one fp32 accumulated score per query head

    def _accumulator(self, layer, batch, heads, keys, device):
        acc = self.state.get(layer)
        if acc is None:
            acc = torch.zeros(batch, heads, keys, dtype=torch.float32, device=device)
        elif acc.shape[-1] < keys:
            acc = torch.nn.functional.pad(acc, (0, keys - acc.shape[-1]))
        self.state[layer] = acc
        return acc

    def observe_dense(self, layer, query, key, scaling):
        batch, heads, rows, _ = query.shape
        keys = key.shape[2]
        acc = self._accumulator(layer, batch, heads, keys, query.device)
        positions = torch.arange(keys, device=query.device)
        for first in range(0, rows, _ROW_CHUNK):
            block = query[:, :, first : first + _ROW_CHUNK]
            row_positions = keys - rows + first + torch.arange(block.shape[2], device=query.device)
            # Keys after the block's last row get probability 0 from every row of the block: leave
            # them out (a long prefill then costs half the products and exponentials).
            seen = keys - rows + first + block.shape[2]
            logits = grouped_logits(block, key[:, :, :seen], scaling)
            logits = logits.masked_fill(positions[None, :seen] > row_positions[:, None], float("-inf"))
            acc[..., :seen] += torch.softmax(logits, dim=-1).sum(dim=2)

    def scores(self, layer, query, key, scaling):
        batch, heads = query.shape[:2]
        acc = self._accumulator(layer, batch, heads, key.shape[2], query.device)
        return acc[:, :, None, : key.shape[2]].expand(batch, heads, query.shape[2], key.shape[2])

    def select(self, layer, query, key, value, budget, scaling):
        scores = self.scores(layer, query, key, scaling)
        recent = budget.local_tokens + int(budget.heavy_tokens * self.recent_fraction)
        if recent > budget.local_tokens:  # the latest `recent` positions up to each row come first
            keys, rows = key.shape[2], query.shape[2]
            positions = torch.arange(keys, device=query.device)
            row_positions = keys - rows + torch.arange(rows, device=query.device)
            is_recent = positions[None, :] > row_positions[:, None] - recent
            scores = scores.masked_fill(is_recent, float("inf"))
        return ops.topk_from_scores(
            scores,
            sink_tokens=budget.sink_tokens,
            local_tokens=budget.local_tokens,
            budget_tokens=budget.heavy_tokens,
        )

    def observe_sparse(self, layer, query, key, indices, counts, lse, scaling):
        batch, heads, rows, _ = query.shape
        keys = key.shape[2]
        acc = self._accumulator(layer, batch, heads, keys, query.device)
        # Probabilities of the selected keys only: gather them, exp(logit - lse), scatter-add.
        slots = torch.arange(indices.shape[-1], device=query.device)
        valid = repeat_kv_heads(slots < counts[..., None], heads // indices.shape[1])  # (B, Hq, P, K)
        positions = repeat_kv_heads(indices, heads // indices.shape[1]).long().clamp(min=0)
        logits = grouped_logits(query, key, scaling).gather(-1, positions)
        probs = torch.exp(logits - lse[..., None]) * valid
        acc.scatter_add_(-1, positions.flatten(2), probs.flatten(2))
