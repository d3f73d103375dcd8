"""How the evaluation runs its selectors inside the model: through the package's one attention function.

:func:`evaluation_attention` switches the model to the ``"hashattention"`` attention
(:func:`hashattention.attention.hashattention_attention_forward`) and adds a forward pre-hook to
every attention module. While a :class:`SparseRun` is active (see :func:`activate`) the hook hands
each layer a :class:`SelectorLayer`, the :class:`~hashattention.attention.KeySelection` of the run's
selector, and the attention function splits the query rows by position:

* rows at positions ``< sparse_from`` run dense (SDPA) and are shown to the selector
  (:meth:`Selector.observe_dense`), e.g. for H2O's statistics;
* rows at positions ``>= sparse_from`` ask the selector for ``(indices, counts)`` under the
  run's :class:`Budget` and attend through :func:`hashattention.sparse_attention`; a
  :class:`~.metrics.SelectionRecorder`, when given, measures recall and attention mass there.

The full-model selector (``dense = True``) runs every row through SDPA (and is recorded as
selecting everything). Without an active run the layers run plain SDPA.

Scope: batch without padding (each call's query rows are the last ``L`` positions of its
``N`` keys), which is how the harness drives the model (one sequence at a time).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional

import torch
from torch import Tensor

from ..attention import ATTENTION_NAME, KeySelection, register
from ..patching import decoder_layers
from .metrics import SelectionRecorder, selection_mask
from .selectors.base import Budget, Selector

_HOOKS_ATTRIBUTE = "_hashattention_evaluation_hooks"


@dataclasses.dataclass
class SparseRun:
    """What the evaluated model does while the run is active.

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


class SelectorLayer(KeySelection):
    """One attention layer under a :class:`SparseRun`: its selector chooses the keys of the sparse rows."""

    def __init__(self, run: SparseRun, layer: int):
        self.run, self.layer = run, layer
        self.selector: Selector = run.selector
        self.sequential_rows = self.selector.sequential_rows

    def _dense_rows(self, rows: int, keys: int) -> int:
        """The call's rows before ``sparse_from`` (its rows are the last ``rows`` of ``keys`` positions)."""
        if self.run.sparse_from is None:
            return rows
        return min(max(self.run.sparse_from - (keys - rows), 0), rows)

    def sparse_rows(self, rows: int, keys: int) -> int:
        return 0 if self.selector.dense else rows - self._dense_rows(rows, keys)

    def observe_dense(self, query: Tensor, key: Tensor, scaling: float) -> None:
        rows, keys = query.shape[2], key.shape[2]
        before = self._dense_rows(rows, keys)
        if before:
            self.selector.observe_dense(self.layer, query[:, :, :before], key[:, :, : keys - rows + before], scaling)
        if before < rows and self.run.recorder is not None:
            # The full model's rows past sparse_from: it selects every key.
            everything = torch.ones(query.shape[0], query.shape[1], rows - before, keys, dtype=torch.bool,
                                    device=query.device)
            self.run.recorder.record(self.layer, query[:, :, before:], key, everything, scaling)

    def select(self, query, key, value, scaling, attention_mask, cache_layer, start_layer):
        return self.selector.select(self.layer, query, key, value, self.run.budget, scaling)

    def observe_sparse(self, query, key, indices, counts, lse, scaling):
        self.selector.observe_sparse(self.layer, query, key, indices, counts, lse, scaling)
        if self.run.recorder is not None:
            selected = selection_mask(indices, counts, key.shape[2], query.shape[1])
            self.run.recorder.record(self.layer, query, key, selected, scaling)


def _hand_over_the_active_run(module, args, kwargs):
    """Forward pre-hook of an attention module: its :class:`SelectorLayer` under the active run, if any."""
    run = _ACTIVE
    kwargs["hashattention"] = SelectorLayer(run, module.layer_idx) if run is not None and run.selector else None
    return args, kwargs


@contextlib.contextmanager
def evaluation_attention(model) -> Iterator[None]:
    """Run ``model``'s attention through the active :class:`SparseRun` for the block, then restore the model.

    Nests: an inner block inside an outer one on the same model changes nothing.
    """
    if getattr(model, _HOOKS_ATTRIBUTE, None) is not None:
        yield
        return
    register()
    previous = model.config._attn_implementation
    hooks = [layer.self_attn.register_forward_pre_hook(_hand_over_the_active_run, with_kwargs=True)
             for layer in decoder_layers(model)]
    setattr(model, _HOOKS_ATTRIBUTE, hooks)
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        delattr(model, _HOOKS_ATTRIBUTE)
        model.set_attn_implementation(previous)
