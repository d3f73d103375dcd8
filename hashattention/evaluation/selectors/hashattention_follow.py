"""HashAttention plus the successors of the keys the previous row attended to most (an experiment).

Copying -- a needle's value, a code word, a list item -- runs on heads that attend, at each decode
step, to the position right after the one they attended to at the step before: if step t - 1
copied the token at position p, step t wants position p + 1. The learned signatures must find that
position again from scratch at every step, and the evaluation's wrong answers are broken copies
("dvz" for "dvlrm"), i.e. the copy loses its place. ``hashattention-follow`` keeps plain
HashAttention per query head and hands ``follow_tokens`` of the heavy budget ``m`` to the
successors ``p + 1`` of the ``follow_tokens`` keys with the largest logits among the keys the same
head's previous row attended to (the sparse attention's own keys; the prompt's last row, which runs
dense, seeds the first step). The successors are scored +inf, so they are kept whatever their
Hamming score; the rest of ``m`` goes by Hamming score as usual. Same budget contract, same sparse
attention, no extra memory per token: the state is ``follow_tokens`` positions per head and layer.

``hashattention-follow-group`` does the same on group-shared HashAttention: each query head of a KV
group follows its own ``follow_tokens`` strongest keys among those the group's shared selection
chose, and the group's selection forces the union of their successors.

``hashattention-follow-keep`` forces the followed keys ``p`` themselves as well as ``p + 1``: a head
that reads a needle's key while it copies the value (or a list item's context while it copies the
item) wants both at the next step. Up to ``2 * follow_tokens`` forced positions.
"""

from __future__ import annotations

import torch

from ... import ops
from .base import grouped_logits
from .hashattention_selector import HashAttentionSelector
from .signature_cache import cached_key_signatures


class FollowAttended(HashAttentionSelector):
    name = "hashattention-follow"
    variants = {"": {"follow_tokens": 8}, "-32": {"follow_tokens": 32},
                "-group": {"follow_tokens": 8, "selection": "kv"},
                "-keep": {"follow_tokens": 8, "keep_attended": True}}
    sequential_rows = True  # a row's selection depends on the previous row's attention

    def __init__(self, follow_tokens: int = 8, selection: str = "query", keep_attended: bool = False):
        super().__init__(selection=selection)
        if not isinstance(follow_tokens, int) or follow_tokens < 1:
            raise ValueError(f"follow_tokens must be a positive int, got {follow_tokens!r}")
        if not isinstance(keep_attended, bool):
            raise ValueError(f"keep_attended must be a bool, got {keep_attended!r}")
        self.follow_tokens = follow_tokens
        self.keep_attended = keep_attended

    def identity(self):
        identity = {**super().identity(), "follow_tokens": self.follow_tokens}
        if self.keep_attended:  # only when set, so that the earlier rows' cache keys stay valid
            identity["keep_attended"] = True
        return identity

    def _remember(self, layer: int, logits: torch.Tensor, positions: torch.Tensor = None) -> None:
        """Keep the positions of the ``follow_tokens`` largest logits ``(B, Hq, 1, K)`` of the last row:
        key ``k`` is at ``positions[..., k]`` (``K = N`` keys in order when None)."""
        top = logits.topk(min(self.follow_tokens, logits.shape[-1]), dim=-1)
        chosen = top.indices if positions is None else positions.gather(-1, top.indices)
        self.state[("follow", layer)] = torch.where(torch.isfinite(top.values), chosen, -1)[:, :, -1]  # -1: none

    def observe_dense(self, layer, query, key, scaling):
        # The prompt's last row sees every key: its strongest keys seed the first sparse row.
        self._remember(layer, grouped_logits(query[:, :, -1:], key, scaling))

    def observe_sparse(self, layer, query, key, indices, counts, lse, scaling):
        # Only the keys the row attended to compete: its selected slots, padding at -inf. A shared
        # selection (B, Hkv, P, K) serves every query head of its group.
        group = query.shape[1] // indices.shape[1]
        positions = indices[:, :, -1:].long().clamp(min=0).repeat_interleave(group, dim=1)  # (B, Hq, 1, K)
        counts = counts[:, :, -1:].repeat_interleave(group, dim=1)
        valid = torch.arange(indices.shape[-1], device=indices.device) < counts[..., None]
        logits = grouped_logits(query[:, :, -1:], key, scaling).gather(-1, positions)
        self._remember(layer, torch.where(valid, logits, float("-inf")), positions)

    def select(self, layer, query, key, value, budget, scaling):
        adapter = self.adapters[layer]
        key_signatures = cached_key_signatures(self.state, layer, key, adapter.key_signatures)
        scores = ops.hamming_scores(adapter.query_signatures(query), key_signatures,
                                    self.selection_heads(self.shape)).float()  # (B, Hs, P, N)
        followed = self.state.get(("follow", layer))
        keys = key.shape[2]
        if followed is not None and budget.heavy_tokens > 0:
            followed = followed[:, :, : min(self.follow_tokens, budget.heavy_tokens)]
            # (B, Hs, F'): a group-shared selection takes its query heads' followed keys together.
            followed = followed.reshape(followed.shape[0], scores.shape[1], -1)
            successors = followed[:, :, None, :] + 1
            if self.keep_attended:  # the followed keys themselves too (their p + 0)
                successors = torch.cat([successors, followed[:, :, None, :]], dim=-1)
                followed = torch.cat([followed, followed], dim=-1)
            successors = successors.expand(-1, -1, scores.shape[2], -1)
            usable = (followed[:, :, None, :] >= 0) & (successors < keys)
            # Counted, not scattered as values: two successors may land on one position (the clamped
            # unusable ones included). Positions past a row are masked by the selection itself.
            hits = torch.zeros(scores.shape, dtype=torch.int32, device=scores.device)
            hits.scatter_add_(-1, successors.clamp(min=0, max=keys - 1), usable.to(torch.int32))
            scores = scores.masked_fill(hits > 0, torch.inf)
        return ops.topk_from_scores(scores, sink_tokens=budget.sink_tokens, local_tokens=budget.local_tokens,
                                    budget_tokens=budget.heavy_tokens)
