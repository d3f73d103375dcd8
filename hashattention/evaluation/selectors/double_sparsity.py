"""Double Sparsity (Yang et al., 2024): approximate scores from a few outlier key channels.

Offline, for each query head, the ``r`` channels with the largest calibration importance
``mean|q_c| * mean|k_c|`` (the "qk" criterion: the mean of ``|q_c k_c|`` over all query-key
pairs factors into this product) are chosen from a dense pass over calibration text. At
decode the score of a key is the partial dot product over those channels. The label cache
holds ``r`` fp16 channels per token and query head: ``r = 2`` matches HashAttention's 32 bits
per query head (the paper's equal-memory comparison); ``r = 8`` is the method's own 1/8 ratio
at head_dim 64.
"""

from __future__ import annotations

import torch

from .base import Selector, SelectorUnavailable, repeat_kv_heads


def outlier_channels(query, key, channels: int):
    """int64 ``(Hq, channels)``: top channels per query head from calibration ``(1, Hq, T, D)`` / ``(1, Hkv, T, D)``."""
    key_rep = repeat_kv_heads(key, query.shape[1] // key.shape[1])
    importance = query.float().abs().mean(dim=(0, 2)) * key_rep.float().abs().mean(dim=(0, 2))  # (Hq, D)
    return importance.topk(channels, dim=-1).indices.sort(dim=-1).values


class DoubleSparsity(Selector):
    name = "double_sparsity"
    variants = {"-r2": {"channels": 2}, "-r8": {"channels": 8}}

    def __init__(self, channels: int = 2):
        super().__init__()
        if channels < 1:
            raise ValueError(f"channels must be >= 1, got {channels}")
        self.channels = channels
        self.layer_channels = {}

    def prepare(self, setup):
        super().prepare(setup)
        if self.channels > setup.shape.head_dim:
            raise SelectorUnavailable(f"channels ({self.channels}) exceed head_dim ({setup.shape.head_dim})")
        if setup.identity_only:
            return
        if setup.calibration is None:
            raise SelectorUnavailable("double_sparsity needs calibration queries and keys")
        self.layer_channels = {
            layer: outlier_channels(q, k, self.channels) for layer, (q, k) in setup.calibration.items()
        }

    def aux_bits_per_token(self, shape):
        return 16.0 * self.channels * shape.num_query_heads

    def scores(self, layer, query, key, scaling):
        channels = self.layer_channels[layer].to(query.device)  # (Hq, r)
        batch, heads, rows, _ = query.shape
        key_rep = repeat_kv_heads(key, heads // key.shape[1])
        q = query.float().gather(-1, channels[None, :, None, :].expand(batch, heads, rows, -1))
        k = key_rep.float().gather(-1, channels[None, :, None, :].expand(batch, heads, key.shape[2], -1))
        return torch.matmul(q, k.transpose(-1, -2))
