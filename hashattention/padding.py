"""``torch.ops.hashattention.first_visible_key``: where each row of a boolean mask first is True.

The sparse rows of a forward read their sequence's left-padding offset from SDPA's boolean mask:
the first key the last query row may see. That is a reduction over the ``N`` keys of the cache
(131K at 128K context), and it is an opaque op on purpose, not inline torch code:

* under torch.compile, inductor fused the inline reduction with the budget arithmetic of
  several layers that used its result, and Triton 3.6 (torch 2.11's) failed to compile that kernel
  ("operand #1 does not dominate this use" in TritonGPURemoveLayoutConversions; H200,
  4-layer Llama, B = 2, 4K context, left padding). As an op, the reduction runs ATen's own
  kernels and inductor only sees its ``(B,)`` result;
* the reduction is ``min(where(mask, position, N))``, not ``argmax``: ATen and inductor both
  split a min across many blocks, while an argmax over all N keys ran in one block (~0.6 ms
  per decode step at 128K when every layer did it).

The op has no data-dependent shapes and no host synchronisation, so it can be captured in a CUDA
graph.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_visible(visible: Tensor) -> None:
    if visible.dtype != torch.bool or visible.dim() != 2:
        raise ValueError(f"visible must be a 2-D bool tensor (B, N), got {visible.dtype} of shape {tuple(visible.shape)}")


@torch.library.custom_op("hashattention::first_visible_key", mutates_args=())
def first_visible_key(visible: Tensor) -> Tensor:
    """int32 ``(B,)``: index of the first True of each row of ``visible`` (bool ``(B, N)``); 0 for none."""
    _check_visible(visible)
    keys = visible.shape[-1]
    if keys == 0:
        return torch.zeros(visible.shape[0], dtype=torch.int32, device=visible.device)
    positions = torch.arange(keys, dtype=torch.int32, device=visible.device)
    first = torch.where(visible, positions, keys).amin(dim=-1)
    return torch.where(first == keys, 0, first).to(torch.int32)


@first_visible_key.register_fake
def _first_visible_key_fake(visible: Tensor) -> Tensor:
    _check_visible(visible)
    return visible.new_empty(visible.shape[:1], dtype=torch.int32)
