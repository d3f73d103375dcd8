"""The interface every selector implements, and the budget contract they all share.

A selector decides, for each query row that runs sparse, which cached key positions the row
attends to. Every selector is held to the same contract (:class:`Budget`): the sink window,
the local window and ``heavy_tokens`` more positions chosen by the selector, through
:func:`hashattention.topk_from_scores` (or the fused :func:`hashattention.hamming_topk`),
and the selected rows go through the same :func:`hashattention.sparse_attention` op.

The evaluation attention hook (:mod:`hashattention.evaluation.attention_hook`) calls, per
layer and forward call:

* :meth:`Selector.observe_dense` with the rows that run dense (prefill), so stateful
  selectors (H2O) can accumulate statistics;
* :meth:`Selector.select` with the rows that run sparse, returning ``(indices, counts)``;
* :meth:`Selector.observe_sparse` with what the sparse attention produced.

Shapes: ``B`` batch, ``Hq`` query heads, ``Hkv`` KV heads, ``Hs`` selection heads (``Hq`` or
``Hkv``), ``P`` sparse query rows (the last rows of the call, at positions ``N - P .. N - 1``),
``N`` cached keys, ``D`` head dim. Queries and keys are post-RoPE.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, ClassVar, Dict, Optional, Tuple

import torch
from torch import Tensor

from ... import ops
from ...config import heavy_tokens


class SelectorUnavailable(RuntimeError):
    """Raised by :meth:`Selector.prepare` when a selector cannot run (e.g. no trained adapters)."""


@dataclasses.dataclass(frozen=True)
class Budget:
    """Tokens one sparse query row attends to: ``sink + local + heavy`` (the shared contract).

    ``for_sparsity(n, s)`` gives sparsity ``s`` the meaning it has in :class:`hashattention.HashAttentionConfig`
    (:func:`hashattention.config.heavy_tokens`): ``floor(n / s)`` attended tokens in total, windows
    included, where ``n`` is the context length when sparse decoding starts (fixed for the whole run,
    so every method gets the same budget at every row).
    """

    sink_tokens: int
    local_tokens: int
    heavy_tokens: int

    def __post_init__(self):
        for name in ("sink_tokens", "local_tokens", "heavy_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"Budget.{name} must be a non-negative int, got {value!r}")
        if self.total_tokens < 1:
            raise ValueError("Budget must select at least one token (sink + local + heavy >= 1)")

    @property
    def total_tokens(self) -> int:
        return self.sink_tokens + self.local_tokens + self.heavy_tokens

    @classmethod
    def for_sparsity(cls, context_tokens: int, sparsity: float, sink_tokens: int, local_tokens: int) -> "Budget":
        if sparsity < 1:
            raise ValueError(f"sparsity must be >= 1, got {sparsity}")
        if context_tokens < 1:
            raise ValueError(f"context_tokens must be >= 1, got {context_tokens}")
        heavy = heavy_tokens(context_tokens, sparsity, None, sink_tokens + local_tokens)
        return cls(sink_tokens, local_tokens, heavy)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The attention layout of the evaluated model."""

    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group_size(self) -> int:
        return self.num_query_heads // self.num_kv_heads

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, heads, getattr(config, "num_key_value_heads", None) or heads, head_dim)


@dataclasses.dataclass
class SelectorSetup:
    """What :meth:`Selector.prepare` may use.

    Attributes:
        shape: the model's attention layout.
        calibration: per layer ``(query (1, Hq, T, D), key (1, Hkv, T, D))`` post-RoPE tensors
            from a dense pass over calibration text (never the evaluation text), or None.
        adapters_dir: directory of trained adapters (``HashAdapters.save_pretrained`` layout).
        group_adapters_dir: adapters for group-shared selection (``key_heads="kv"``); None:
            the group-shared selector reuses ``adapters_dir``.
        seed: for selectors with random parameters (LSH).
        identity_only: prepare only what :meth:`Selector.identity` and
            :meth:`Selector.aux_bits_per_token` need (a report from the result cache, without the
            model); :meth:`Selector.select` will not be called.
    """

    shape: ModelShape
    calibration: Optional[Dict[int, Tuple[Tensor, Tensor]]] = None
    adapters_dir: Optional[str] = None
    group_adapters_dir: Optional[str] = None
    seed: int = 0
    identity_only: bool = False


class Selector:
    """Base class: scores -> :func:`hashattention.topk_from_scores` under the shared budget.

    Subclasses set ``name`` (unique; the registry discovers every subclass that has one) and
    either override :meth:`scores` (higher is better, ``(B, Hs, P, N)``, any real dtype; the
    selection masks non-causal positions itself) or :meth:`select` directly.

    ``variants`` maps a suffix to constructor keyword arguments, so one class can offer
    several configurations (``lsh-32``, ``lsh-256`` ...); the empty suffix is the bare name.
    """

    name: ClassVar[str] = ""
    variants: ClassVar[Dict[str, Dict[str, Any]]] = {"": {}}
    #: rows are selected with their keys only (run dense through SDPA) -- the full model.
    dense: ClassVar[bool] = False
    #: a row's selection depends on more than its own query and each key alone -- the
    #: attention of earlier sparse rows (H2O) or the other keys of a page (Quest): the
    #: attention function (``hashattention.attention``) then feeds the sparse rows one at a
    #: time, each against the keys up to its position, exactly as token-by-token decoding would.
    sequential_rows: ClassVar[bool] = False
    #: "query": one selection per query head; "kv": one per KV group (summed scores).
    selection: str = "query"

    def __init__(self, **options):
        if options:
            raise TypeError(f"{type(self).__name__} takes no options, got {sorted(options)}")
        self.state: Dict[Any, Any] = {}
        self.shape: Optional[ModelShape] = None

    # ------------------------------------------------------------------ lifecycle
    def prepare(self, setup: SelectorSetup) -> None:
        """Once per evaluation, before any sequence. May raise :class:`SelectorUnavailable`."""
        self.shape = setup.shape

    def start_sequence(self) -> None:
        """Forget every per-sequence state (a new sample starts)."""
        self.state = {}

    def save_state(self) -> Dict[Any, Any]:
        """A copy of the per-sequence state (taken after the shared dense prefill)."""
        return copy.deepcopy(self.state)

    def load_state(self, state: Dict[Any, Any]) -> None:
        self.state = copy.deepcopy(state)

    def identity(self) -> Dict[str, Any]:
        """What makes this selector's results what they are, beyond the evaluation settings
        (part of the result cache's key: change it and cached results are recomputed)."""
        return {"selector": getattr(self, "registered_name", self.name), "class": type(self).__qualname__}

    def aux_bits_per_token(self, shape: ModelShape) -> Optional[float]:
        """Auxiliary memory per cached token per layer (all heads), in bits; None if not applicable."""
        return 0.0

    # ------------------------------------------------------------------ hooks
    def selection_heads(self, shape: ModelShape) -> int:
        return shape.num_query_heads if self.selection == "query" else shape.num_kv_heads

    def observe_dense(self, layer: int, query: Tensor, key: Tensor, scaling: float) -> None:
        """Rows at positions ``N - L .. N - 1`` ran dense (query ``(B, Hq, L, D)``, key ``(B, Hkv, N, D)``)."""

    def scores(self, layer: int, query: Tensor, key: Tensor, scaling: float) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement scores() or select()")

    def select(self, layer: int, query: Tensor, key: Tensor, value: Tensor, budget: Budget,
               scaling: float) -> Tuple[Tensor, Tensor]:
        """int32 ``(indices (B, Hs, P, K), counts (B, Hs, P))`` for the last ``P`` rows."""
        scores = self.scores(layer, query, key, scaling)
        return ops.topk_from_scores(
            scores,
            sink_tokens=budget.sink_tokens,
            local_tokens=budget.local_tokens,
            budget_tokens=budget.heavy_tokens,
        )

    def observe_sparse(self, layer: int, query: Tensor, key: Tensor, indices: Tensor, counts: Tensor,
                       lse: Tensor, scaling: float) -> None:
        """The sparse rows attended to ``indices`` with log-sum-exp ``lse`` ``(B, Hq, P)``."""


def repeat_kv_heads(x: Tensor, group_size: int) -> Tensor:
    """``(B, Hkv, N, D)`` -> ``(B, Hkv * group, N, D)``: the key each query head reads."""
    return x if group_size == 1 else x.repeat_interleave(group_size, dim=1)


def grouped_logits(query: Tensor, key: Tensor, scaling: float) -> Tensor:
    """float32 ``q . k * scaling`` ``(B, Hq, P, N)`` of each query head against its KV head's keys.

    Query heads ``g * G .. g * G + G - 1`` share KV head ``g``: one batched product per KV head,
    without materialising the keys repeated for every query head.
    """
    batch, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.float().reshape(batch, kv_heads, (heads // kv_heads) * rows, dim)
    logits = torch.matmul(grouped, key.float().transpose(-1, -2)) * scaling
    return logits.view(batch, heads, rows, key.shape[2])


def sum_over_groups(scores: Tensor, selection_heads: int) -> Tensor:
    """``(B, Hq, P, N)`` -> ``(B, Hs, P, N)``: group-shared scores are the sum over the group's query heads."""
    batch, heads, rows, keys = scores.shape
    if selection_heads == heads:
        return scores
    return scores.view(batch, selection_heads, heads // selection_heads, rows, keys).sum(dim=2)
