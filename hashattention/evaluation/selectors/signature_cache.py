"""Key signatures kept per layer and extended as keys are appended (each key encoded once)."""

from __future__ import annotations

from typing import Callable, Dict

import torch
from torch import Tensor


def cached_key_signatures(state: Dict, layer: int, key: Tensor, encode: Callable[[Tensor], Tensor]) -> Tensor:
    """int32 ``(B, Hk, N, W)`` signatures of ``key`` ``(B, Hkv, N, D)``; only keys not seen yet are encoded.

    Assumes the keys of one sequence only grow (a prefix never changes), which holds within a
    sequence; :meth:`Selector.start_sequence` clears the state between sequences.
    """
    keys = key.shape[2]
    cached = state.get(("signatures", layer))
    done = 0 if cached is None else cached.shape[2]
    if done < keys:
        fresh = encode(key[:, :, done:])
        cached = fresh if cached is None else torch.cat([cached, fresh], dim=2)
        state[("signatures", layer)] = cached
    return cached[:, :, :keys]
