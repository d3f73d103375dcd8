"""``torch.ops.hashattention.selection_bounds``: a forward pass's valid lengths, left-padding offsets
and heavy-token budgets, in one opaque op.

Every sparse layer of a forward needs the same three int32 ``(B,)`` tensors. The model's first sparse
layer computes them and later layers read them (:class:`hashattention.cache.SharedSelectionBounds`).
Computed by inline torch code, they were a few pointwise expressions, and inductor does not keep a
pointwise result for the many opaque ops that read it: it recomputed the expressions once per reading
layer, into one-thread kernels (47 launches per decode step of a 32-layer Llama, ~70 us at B = 4 on an
H200, all before the first layer's attention). An op's outputs are buffers that every layer reads.

The op runs ATen kernels (the reduction of the mask is :func:`hashattention.padding.first_visible_key`'s),
has no data-dependent shapes and no host synchronisation, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .config import heavy_tokens
from .padding import first_visible_key


def _check(lengths: Tensor, visible: Optional[Tensor], sparsity: Optional[float], budget_tokens: Optional[int],
           window_tokens: int, dense_below_tokens: int) -> None:
    if lengths.dim() != 1 or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lengths must be a 1-D int32 or int64 tensor (B,), got {lengths.dtype} of shape "
                         f"{tuple(lengths.shape)}")
    if visible is not None:
        if visible.dtype != torch.bool or visible.dim() != 2 or visible.shape[0] != lengths.shape[0]:
            raise ValueError(f"visible must be a 2-D bool tensor (B, N) with B = {lengths.shape[0]}, got "
                             f"{visible.dtype} of shape {tuple(visible.shape)}")
        if visible.device != lengths.device:
            raise ValueError(f"visible is on {visible.device} but lengths on {lengths.device}")
    if (sparsity is None) == (budget_tokens is None):
        raise ValueError("exactly one of sparsity and budget_tokens must be given")
    if sparsity is not None and not sparsity >= 1.0:
        raise ValueError(f"sparsity must be >= 1, got {sparsity}")
    if budget_tokens is not None and budget_tokens < 0:
        raise ValueError(f"budget_tokens must be >= 0, got {budget_tokens}")
    if window_tokens < 0 or dense_below_tokens < 0:
        raise ValueError(f"window_tokens and dense_below_tokens must be >= 0, got {window_tokens}, "
                         f"{dense_below_tokens}")


@torch.library.custom_op("hashattention::selection_bounds", mutates_args=())
def selection_bounds(
    lengths: Tensor,
    visible: Optional[Tensor],
    sparsity: Optional[float],
    budget_tokens: Optional[int],
    window_tokens: int,
    dense_below_tokens: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(lengths, start_positions, budgets)``, each int32 ``(B,)``.

    Args:
        lengths: int32 or int64 ``(B,)``, the valid (written) key positions of each sequence.
        visible: bool ``(B, N)``, the keys the last query row may see (SDPA's mask row); its first
            True is the sequence's left-padding offset. None: no padding (offsets 0).
        sparsity, budget_tokens: exactly one; the total tokens per sequence are
            ``floor((lengths - offset) / sparsity)`` or ``budget_tokens``.
        window_tokens: sink + local tokens, taken from the total; budgets are what is left.
        dense_below_tokens: sequences with fewer valid keys than this keep all of them.

    The budgets are :func:`hashattention.config.heavy_tokens` of the valid keys ``lengths - offset``.
    """
    _check(lengths, visible, sparsity, budget_tokens, window_tokens, dense_below_tokens)
    starts = torch.zeros_like(lengths, dtype=torch.int32) if visible is None else first_visible_key(visible)
    lengths = lengths.to(torch.int32, copy=True)  # an op's outputs never alias its inputs
    budgets = heavy_tokens(lengths - starts, sparsity, budget_tokens, window_tokens, dense_below_tokens)
    return lengths, starts, budgets


@selection_bounds.register_fake
def _selection_bounds_fake(lengths, visible, sparsity, budget_tokens, window_tokens, dense_below_tokens):
    _check(lengths, visible, sparsity, budget_tokens, window_tokens, dense_below_tokens)
    shape = lengths.shape
    return (lengths.new_empty(shape, dtype=torch.int32), lengths.new_empty(shape, dtype=torch.int32),
            lengths.new_empty(shape, dtype=torch.int32))
