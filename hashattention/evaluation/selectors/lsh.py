"""Random-projection LSH (SimHash; the signatures of MagicPIG): Hamming similarity of random hyperplane bits.

Per layer and KV head a Gaussian matrix ``(D, bits)`` (fixed seed) projects queries and keys;
the signs are the signature bits. The query heads of a KV group use their KV head's matrix,
so query and key share hyperplanes and the Hamming similarity estimates their angle. Keys are
encoded once per KV head (``bits`` per token per KV head) and selection runs through the same
fused :func:`hashattention.hamming_topk` as HashAttention, per query head.
"""

from __future__ import annotations

import torch

from ... import ops
from .base import Selector
from .signature_cache import cached_key_signatures


class RandomProjectionLSH(Selector):
    name = "lsh"
    variants = {f"-{bits}": {"bits": bits} for bits in (32, 256, 512, 1024)}

    def __init__(self, bits: int = 32):
        super().__init__()
        if bits < 32 or bits % 32:
            raise ValueError(f"bits must be a positive multiple of 32, got {bits}")
        self.bits = bits
        self.projections = {}

    def prepare(self, setup):
        super().prepare(setup)
        shape = setup.shape
        generator = torch.Generator().manual_seed(setup.seed * 1_000_003 + self.bits)
        self.projections = {}
        for layer in range(shape.num_layers):
            weight = torch.randn(shape.num_kv_heads, shape.head_dim, self.bits, generator=generator)
            bias = torch.zeros(shape.num_kv_heads, self.bits)
            group = shape.group_size
            self.projections[layer] = (
                (weight, bias),
                (weight.repeat_interleave(group, dim=0), bias.repeat_interleave(group, dim=0)),
            )

    def aux_bits_per_token(self, shape):
        return float(self.bits * shape.num_kv_heads)

    def select(self, layer, query, key, value, budget, scaling):
        (key_w, key_b), (query_w, query_b) = self.projections[layer]
        key_signatures = cached_key_signatures(
            self.state, layer, key, lambda k: ops.encode_signatures(k, [key_w.to(k.device)], [key_b.to(k.device)])
        )
        query_signatures = ops.encode_signatures(query, [query_w.to(query.device)], [query_b.to(query.device)])
        return ops.hamming_topk(
            query_signatures,
            key_signatures,
            selection_heads=self.selection_heads(self.shape),
            sink_tokens=budget.sink_tokens,
            local_tokens=budget.local_tokens,
            budget_tokens=budget.heavy_tokens,
        )
