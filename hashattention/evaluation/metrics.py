"""Metrics: selection quality (recall of the true top-k, attention mass), token NLL, RULER string match.

Selection metrics are measured at the rows that run sparse, against the true scores of the
same queries and keys (``q . k * scaling``, causal):

* **recall@k**: the share of the true top-``k`` keys that the selection contains, where the top
  is taken among the keys outside the row's sink and local windows (``sink <= j <= p - local``;
  the windows are always selected, so counting them would only inflate recall -- the same
  definition the adapter training uses for its labels). Rows with no eligible key are skipped;
  rows with fewer than ``k`` eligible keys use all of them.
* **attention mass**: the share of the row's dense softmax probability that falls on the
  selected keys (windows included); 1 for the full model.

Both are per query head; a group-shared selection counts for each head of its group.
"""

from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .selectors.base import grouped_logits, repeat_kv_heads


def selection_mask(indices: Tensor, counts: Tensor, keys: int, query_heads: int) -> Tensor:
    """bool ``(B, Hq, P, N)`` from int32 ``indices (B, Hs, P, K)`` and ``counts (B, Hs, P)``."""
    batch, heads, rows, width = indices.shape
    valid = torch.arange(width, device=indices.device) < counts[..., None]
    target = torch.where(valid & (indices >= 0), indices, keys).long()
    mask = torch.zeros(batch, heads, rows, keys + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(-1, target, True)
    return repeat_kv_heads(mask[..., :keys], query_heads // heads)


def true_logits(query: Tensor, key: Tensor, scaling: float) -> Tensor:
    """float32 causal ``q . k * scaling`` ``(B, Hq, P, N)`` for the last ``P`` positions (future = -inf)."""
    keys = key.shape[2]
    rows = query.shape[2]
    logits = grouped_logits(query, key, scaling)
    positions = torch.arange(keys, device=query.device)
    row_positions = keys - rows + torch.arange(rows, device=query.device)
    return logits.masked_fill(positions[None, :] > row_positions[:, None], float("-inf"))


def recall_at_k(logits: Tensor, selected: Tensor, sink_tokens: int, local_tokens: int, k: int = 32) -> Tensor:
    """float32 ``(B, Hq, P)``: share of the true top-``k`` eligible keys that are selected (NaN: none eligible).

    Args:
        logits: causal true scores ``(B, Hq, P, N)`` (``-inf`` for future keys), rows at the last positions.
        selected: bool ``(B, Hq, P, N)``.
    """
    keys = logits.shape[-1]
    rows = logits.shape[-2]
    positions = torch.arange(keys, device=logits.device)
    row_positions = keys - rows + torch.arange(rows, device=logits.device)
    eligible = (positions[None, :] >= sink_tokens) & (positions[None, :] <= row_positions[:, None] - local_tokens)
    eligible_count = eligible.sum(-1)  # (P,)
    masked = logits.masked_fill(~eligible, float("-inf"))
    take = min(k, keys)
    if take == 0:
        return torch.full(logits.shape[:-1], float("nan"))
    top = masked.topk(take, dim=-1).indices  # (B, Hq, P, take); slots beyond eligible_count are not real
    real = torch.arange(take, device=logits.device)[None, :] < eligible_count[:, None]  # (P, take)
    hits = (selected.gather(-1, top) & real).sum(-1).float()
    denominator = real.sum(-1).float()  # (P,)
    recall = hits / denominator
    return recall.masked_fill(denominator == 0, float("nan"))


def attention_mass(logits: Tensor, selected: Tensor) -> Tensor:
    """float32 ``(B, Hq, P)``: dense softmax probability of the selected keys."""
    probabilities = torch.softmax(logits, dim=-1)
    return (probabilities * selected).sum(-1)


class SelectionRecorder:
    """Accumulates recall@k and attention mass per layer over every recorded sparse row and head."""

    def __init__(self, sink_tokens: int, local_tokens: int, top_k: int = 32):
        self.sink_tokens, self.local_tokens, self.top_k = sink_tokens, local_tokens, top_k
        self.recall_sum: Dict[int, float] = {}
        self.recall_rows: Dict[int, int] = {}
        self.mass_sum: Dict[int, float] = {}
        self.mass_rows: Dict[int, int] = {}

    def record(self, layer: int, query: Tensor, key: Tensor, selected: Tensor, scaling: float) -> None:
        """``selected``: bool ``(B, Hq, P, N)`` for the last ``P`` rows of ``key`` ``(B, Hkv, N, D)``."""
        logits = true_logits(query, key, scaling)
        recall = recall_at_k(logits, selected, self.sink_tokens, self.local_tokens, self.top_k)
        mass = attention_mass(logits, selected)
        finite = ~torch.isnan(recall)
        self.recall_sum[layer] = self.recall_sum.get(layer, 0.0) + float(recall[finite].sum())
        self.recall_rows[layer] = self.recall_rows.get(layer, 0) + int(finite.sum())
        self.mass_sum[layer] = self.mass_sum.get(layer, 0.0) + float(mass.sum())
        self.mass_rows[layer] = self.mass_rows.get(layer, 0) + mass.numel()

    def per_layer(self) -> Dict[str, List[Optional[float]]]:
        """``{"recall": [...], "mass": [...]}`` means per layer (index = layer; None: nothing recorded)."""
        layers = max(list(self.mass_rows) + [-1]) + 1
        recall = [self.recall_sum[l] / self.recall_rows[l] if self.recall_rows.get(l) else None for l in range(layers)]
        mass = [self.mass_sum[l] / self.mass_rows[l] if self.mass_rows.get(l) else None for l in range(layers)]
        return {"recall": recall, "mass": mass}


def find_spans(ids: Sequence[int], pattern: Sequence[int]) -> List[int]:
    """Every position covered by an occurrence of the token sequence ``pattern`` in ``ids``."""
    ids, pattern = list(ids), list(pattern)
    covered: List[int] = []
    if not pattern:
        return covered
    for start in range(len(ids) - len(pattern) + 1):
        if ids[start : start + len(pattern)] == pattern:
            covered.extend(range(start, start + len(pattern)))
    return sorted(set(covered))


class NeedleRecorder(SelectionRecorder):
    """A :class:`SelectionRecorder` that also measures how much of the dense model's attention to
    given key positions (a task's needle tokens) the selection keeps, at the last recorded row.

    Per layer: ``kept = sum_h p_h(needle and selected)`` and ``total = sum_h p_h(needle)``, with
    ``p_h`` the dense softmax of query head ``h`` at the last row. ``needle_kept()`` is
    ``sum kept / sum total`` over layers: heads that attend to the needle weigh the most, so it
    says whether the retrieval heads keep the answer, which averaged recall does not.
    """

    def __init__(self, sink_tokens: int, local_tokens: int, top_k: int, needle_positions: Sequence[int]):
        super().__init__(sink_tokens, local_tokens, top_k)
        self.needle = torch.tensor(sorted(set(int(p) for p in needle_positions)), dtype=torch.long)
        self.kept: Dict[int, float] = {}
        self.total: Dict[int, float] = {}

    def record(self, layer: int, query: Tensor, key: Tensor, selected: Tensor, scaling: float) -> None:
        super().record(layer, query, key, selected, scaling)
        needle = self.needle[self.needle < key.shape[2]].to(key.device)
        if needle.numel() == 0:
            return
        probabilities = torch.softmax(true_logits(query[:, :, -1:], key, scaling), dim=-1)[..., needle]
        kept = probabilities * selected[:, :, -1:, :][..., needle]
        self.kept[layer] = self.kept.get(layer, 0.0) + float(kept.sum())
        self.total[layer] = self.total.get(layer, 0.0) + float(probabilities.sum())

    def needle_kept(self) -> Optional[float]:
        """Share of the dense attention to the needle that the selection keeps (None: no needle recorded)."""
        total = sum(self.total.values())
        return sum(self.kept.values()) / total if total > 0 else None


def token_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """float64 ``(T,)`` negative log-likelihood of ``targets (T,)`` under ``logits (T, V)``."""
    return torch.nn.functional.cross_entropy(logits.double(), targets, reduction="none")


def mean_ignoring_none(values: Sequence[Optional[float]]) -> Optional[float]:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _normalise(text: str) -> str:
    return text.lower()  # RULER compares lower-cased strings, nothing more


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's ``string_match_all`` for one sample: the share of references found (case-insensitive) in the prediction, in [0, 1]."""
    if not references:
        raise ValueError("references must not be empty")
    text = _normalise(prediction)
    return sum(_normalise(r) in text for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """RULER's ``string_match_part``: 1 if any reference is found in the prediction, else 0."""
    if not references:
        raise ValueError("references must not be empty")
    text = _normalise(prediction)
    return float(any(_normalise(r) in text for r in references))


def task_average_with_error(scores: Mapping[str, Sequence[float]]) -> Tuple[Optional[float], Optional[float]]:
    """The mean over tasks of each task's mean score, and its standard error.

    ``scores`` maps each task to its per-sample scores. The tasks' sample means are independent,
    so the variance of their average is ``sum_t s_t^2 / n_t / T^2``, with ``s_t^2`` the sample
    variance (denominator ``n_t - 1``) of task ``t``'s ``n_t`` scores. The average is None when
    there is no task or a task has no score; the error is None when a task has fewer than two.
    """
    if not scores or any(len(values) == 0 for values in scores.values()):
        return None, None
    tasks = len(scores)
    average = sum(sum(values) / len(values) for values in scores.values()) / tasks
    if any(len(values) < 2 for values in scores.values()):
        return average, None
    variance = 0.0
    for values in scores.values():
        mean = sum(values) / len(values)
        variance += sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)
    return average, math.sqrt(variance) / tasks


def paired_task_difference(scores: Mapping[str, Mapping[int, float]],
                           reference: Mapping[str, Mapping[int, float]]) -> Tuple[Optional[float], Optional[float]]:
    """Task average of ``scores`` minus that of ``reference``, and its standard error, over the
    samples both have (task -> sample index -> score).

    Both were scored on the same prompts, so the error comes from the per-sample differences:
    what makes a prompt hard for both cancels, and the error is the one that matters when asking
    whether a selector is within a point of the dense model. None, None when a task of ``scores``
    has no sample in common with ``reference``.
    """
    differences = {}
    for task, values in scores.items():
        other = reference.get(task, {})
        differences[task] = [values[i] - other[i] for i in sorted(values) if i in other]
    return task_average_with_error(differences)

