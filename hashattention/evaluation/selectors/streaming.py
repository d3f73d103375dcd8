"""StreamingLLM (Xiao et al., 2024): attention sinks plus the most recent tokens, nothing else.

At the same total budget as the other selectors, the heavy part of the budget extends the
local window: the score of a position is the position itself, so the top-m are the latest.
"""

from __future__ import annotations

import torch

from .base import Selector


class StreamingLLM(Selector):
    name = "streaming"

    def scores(self, layer, query, key, scaling):
        batch, _, rows, _ = query.shape
        positions = torch.arange(key.shape[2], dtype=torch.int32, device=query.device)
        return positions.expand(batch, self.selection_heads(self.shape), rows, key.shape[2])
