"""Training targets: which keys a query should select.

For a query at position ``p`` the *eligible* keys are those the budget contract leaves to the
learned selector: outside the sink window ``[0, sink)`` and the local window ``(p - local, p]``,
and causal (``<= p``). The label of an eligible key is 1 iff it is among the ``top_k`` by the target
score; ineligible cells carry no label and are excluded from the loss.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def eligible_keys(query_positions: Tensor, num_keys: int, sink_tokens: int, local_tokens: int) -> Tensor:
    """bool ``(Q, N)``: key ``j`` is eligible for the query at ``p`` iff ``sink <= j <= p - local``."""
    keys = torch.arange(num_keys, device=query_positions.device)
    last = (query_positions - local_tokens)[:, None]
    return (keys[None, :] >= sink_tokens) & (keys[None, :] <= last)


def causal_keys(query_positions: Tensor, num_keys: int) -> Tensor:
    """bool ``(Q, N)``: key ``j <= p``."""
    keys = torch.arange(num_keys, device=query_positions.device)
    return keys[None, :] <= query_positions[:, None]


def target_scores(queries: Tensor, keys: Tensor, value_norms: Optional[Tensor] = None,
                  target: str = "qk") -> Tensor:
    """fp32 ``(Hq, Q, N)`` target scores.

    Args:
        queries: ``(Hq, Q, D)``; keys: ``(Hkv, N, D)`` (repeated over each KV group of ``Hq / Hkv`` heads).
        value_norms: fp32 ``(Hkv, N)``; needed for ``target = "qk_log_value_norm"``.
        target: ``"qk"`` = q·k/√d; ``"qk_log_value_norm"`` = q·k/√d + log‖v‖ (the paper's ranking lemma:
            a key's contribution to the output scales with exp(q·k/√d)·‖v‖).
    """
    heads, kv_heads = queries.shape[0], keys.shape[0]
    if heads % kv_heads:
        raise ValueError(f"queries' heads ({heads}) must be a multiple of keys' heads ({kv_heads})")
    group = heads // kv_heads
    expanded = keys.float().repeat_interleave(group, dim=0)
    scores = torch.matmul(queries.float(), expanded.transpose(1, 2)) / math.sqrt(queries.shape[-1])
    if target == "qk_log_value_norm":
        if value_norms is None:
            raise ValueError("target 'qk_log_value_norm' needs value_norms")
        scores = scores + value_norms.float().clamp_min(1e-12).log().repeat_interleave(group, dim=0)[:, None, :]
    elif target != "qk":
        raise ValueError(f"target must be 'qk' or 'qk_log_value_norm', got {target!r}")
    return scores


def top_k_labels(scores: Tensor, eligible: Tensor, top_k: int, group_size: int = 1,
                 causal: Optional[Tensor] = None) -> Tensor:
    """bool ``(Hq, Q, N)``: the ``top_k`` eligible keys of each (head, query) by ``scores``.

    Args:
        scores: fp32 ``(Hq, Q, N)``; eligible: bool ``(Q, N)``.
        group_size: 1 for per-query-head labels; ``Hq / Hkv`` for group-shared selection, where
            every head of a KV group gets the same labels: the top keys by the group's summed
            attention probability (softmax over the causal keys of each head).
        causal: bool ``(Q, N)`` keys each query attends to (needed when ``group_size > 1``).
    """
    heads = scores.shape[0]
    if heads % group_size:
        raise ValueError(f"group_size ({group_size}) must divide the heads ({heads})")
    masked = scores.masked_fill(~eligible[None], float("-inf"))
    if group_size > 1:
        if causal is None:
            raise ValueError("group-shared labels (group_size > 1) need the causal mask")
        probabilities = torch.softmax(scores.masked_fill(~causal[None], float("-inf")), dim=-1)
        probabilities = probabilities.masked_fill(~eligible[None], float("-inf"))
        grouped = probabilities.unflatten(0, (heads // group_size, group_size))
        # -inf survives the sum only where every head's cell is ineligible (eligibility is shared).
        masked = grouped.sum(dim=1).repeat_interleave(group_size, dim=0)
    k = min(top_k, scores.shape[-1])
    picked = masked.topk(k, dim=-1).indices
    labels = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, picked, True)
    return labels & eligible[None]
