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


def attention_positive_scale(scores: Tensor, labels: Tensor, causal: Tensor, mix: float) -> Tensor:
    """fp32 ``(Hq, Q, N)`` multipliers of the positive cells' loss weight (0 on the other cells).

    A positive's scale is ``(1 - mix) + mix * k * p``, where ``p`` is its attention probability (softmax
    of ``scores`` over the query's causal keys) renormalised over the row's ``k`` positives, so every
    row's scales average 1 over its positives: ``mix = 0`` is the uniform weighting, ``mix = 1`` spreads
    the row's positive weight in proportion to attention (a key holding most of a query's attention,
    as a retrieved token does, takes most of it).

    Args:
        scores: fp32 ``(Hq, Q, N)`` target scores; labels: bool ``(Hq, Q, N)``; causal: bool ``(Q, N)``.
        mix: in ``[0, 1]``.
    """
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"mix must be in [0, 1], got {mix}")
    probabilities = torch.softmax(scores.float().masked_fill(~causal[None], float("-inf")), dim=-1)
    positive = torch.where(labels, probabilities, torch.zeros((), dtype=probabilities.dtype))
    mass = positive.sum(dim=-1, keepdim=True)
    count = labels.sum(dim=-1, keepdim=True).to(probabilities.dtype)
    # Rows whose positives carry no probability (underflow) fall back to the uniform scale.
    share = torch.where(mass > 0, positive / mass.clamp_min(torch.finfo(probabilities.dtype).tiny),
                        labels.to(probabilities.dtype) / count.clamp_min(1))
    scale = (1.0 - mix) + mix * count * share
    return torch.where(labels, scale, torch.zeros((), dtype=scale.dtype))
