"""The evaluation's own attention function for transformers' ``AttentionInterface``.

Registered as ``"hashattention_evaluation"``. While a :class:`SparseRun` is active (see
:func:`activate`), every attention layer of the model splits its query rows by position:

* rows at positions ``< sparse_from`` run dense (SDPA with an explicit causal mask) and are
  shown to the selector (:meth:`Selector.observe_dense`), e.g. for H2O's statistics;
* rows at positions ``>= sparse_from`` ask the selector for ``(indices, counts)`` under the
  run's :class:`Budget` and attend through :func:`hashattention.sparse_attention`; a
  :class:`~.metrics.SelectionRecorder`, when given, measures recall and attention mass there.

The full-model selector (``dense = True``) runs every row through SDPA (and is recorded as
selecting everything). Without an active run the function is plain causal SDPA.

Scope: batch without padding (each call's query rows are the last ``L`` positions of its
``N`` keys), which is how the harness drives the model (one sequence at a time).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.modeling_utils import AttentionInterface

from .. import ops
from .metrics import SelectionRecorder, selection_mask
from .selectors.base import Budget, Selector

ATTENTION_NAME = "hashattention_evaluation"


@dataclasses.dataclass
class SparseRun:
    """What the hook does while active.

    Attributes:
        selector: the selector of the sparse rows (and observer of the dense rows).
        budget: the per-row budget of the sparse rows (ignored by dense selectors).
        sparse_from: first position that runs sparse; ``None`` runs everything dense.
        recorder: measures selection quality at the sparse rows, or None.
    """

    selector: Optional[Selector] = None
    budget: Optional[Budget] = None
    sparse_from: Optional[int] = None
    recorder: Optional[SelectionRecorder] = None


_ACTIVE: Optional[SparseRun] = None


@contextlib.contextmanager
def activate(run: SparseRun) -> Iterator[SparseRun]:
    """Make ``run`` the active run for the duration of the block (not re-entrant)."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("an evaluation SparseRun is already active")
    _ACTIVE = run
    try:
        yield run
    finally:
        _ACTIVE = None


def _dense_attention(query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
    """Causal SDPA for rows at the last positions; ``(B, Hq, L, D)``."""
    rows, keys = query.shape[2], key.shape[2]
    gqa = key.shape[1] != query.shape[1]
    if rows == keys:
        # A prefill from an empty cache: SDPA's own causal path (no (L, N) mask to build or read;
        # on CPU it is the flash kernel, which also skips the masked half -- ~2x faster at 8K).
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    positions = torch.arange(keys, device=query.device)
    row_positions = keys - rows + torch.arange(rows, device=query.device)
    mask = positions[None, :] <= row_positions[:, None]
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa
    )


def _sparse_rows(run: SparseRun, layer: int, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
    """Sparse attention of the last ``P`` rows of ``query`` (positions ``N - P .. N - 1``)."""
    selector, budget = run.selector, run.budget
    keys, rows = key.shape[2], query.shape[2]
    if selector.dense:
        out = _dense_attention(query, key, value, scaling)
        if run.recorder is not None:
            everything = torch.ones(query.shape[0], query.shape[1], rows, keys, dtype=torch.bool, device=query.device)
            run.recorder.record(layer, query, key, everything, scaling)
        return out
    if selector.sequential_rows and rows > 1:
        # Each row's selection depends on the attention of the rows before it: one at a time,
        # each against the keys up to its own position.
        outs = [
            _sparse_rows(run, layer, query[:, :, r : r + 1], key[:, :, : keys - rows + r + 1],
                         value[:, :, : keys - rows + r + 1], scaling)
            for r in range(rows)
        ]
        return torch.cat(outs, dim=2)
    indices, counts = selector.select(layer, query, key, value, budget, scaling)
    out, lse = ops.sparse_attention(query, key, value, indices, counts, scale=scaling)
    selector.observe_sparse(layer, query, key, indices, counts, lse, scaling)
    if run.recorder is not None:
        selected = selection_mask(indices, counts, keys, query.shape[1])
        run.recorder.record(layer, query, key, selected, scaling)
    return out


def evaluation_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
):
    """transformers attention function: ``(out (B, L, Hq, D), None)``."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    run = _ACTIVE
    rows, keys = query.shape[2], key.shape[2]
    if run is None or run.selector is None:
        return _dense_attention(query, key, value, scaling).transpose(1, 2).contiguous(), None
    layer = module.layer_idx
    first_position = keys - rows
    if run.sparse_from is None:
        dense_rows = rows
    else:
        dense_rows = min(max(run.sparse_from - first_position, 0), rows)
    parts = []
    if dense_rows:
        dense_key, dense_value = key[:, :, : first_position + dense_rows], value[:, :, : first_position + dense_rows]
        dense_query = query[:, :, :dense_rows]
        parts.append(_dense_attention(dense_query, dense_key, dense_value, scaling))
        run.selector.observe_dense(layer, dense_query, dense_key, scaling)
    if dense_rows < rows:
        parts.append(_sparse_rows(run, layer, query[:, :, dense_rows:], key, value, scaling))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register the attention function (idempotent). No mask function is registered: the hook
    builds its own causal mask, so transformers skips mask construction."""
    AttentionInterface.register(ATTENTION_NAME, evaluation_attention_forward)


@contextlib.contextmanager
def evaluation_attention(model) -> Iterator[None]:
    """Switch ``model`` to the evaluation attention for the block, then restore its implementation."""
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
