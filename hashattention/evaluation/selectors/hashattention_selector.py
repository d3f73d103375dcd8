"""HashAttention (Desai et al., 2025): learned 32-bit signatures, Hamming top-k.

Loads trained :class:`~hashattention.adapters.HashAdapters` (``save_pretrained`` layout).
``hashattention`` selects per query head, as in the paper; ``hashattention-group`` shares one
selection per KV group (the Hamming scores of the group's query heads are summed), reading
the group-shared adapters when given (``SelectorSetup.group_adapters_dir``), else the same
adapters. Key signatures are encoded once per key, when the key first appears.

``hashattention-w4`` (an experiment) keeps the same 32-bit key signatures but weighs each bit of
the query by how sure the query MLP is of it: score = sum_j w_j * s_qj * s_kj with s = +-1 the
signs and w_j in 1..4 the quantised ``|tanh(f_q(q))_j|`` of the row (:func:`query_bit_weights`).
Training fits ``tanh(f_q) . tanh(f_k)``, so this is closer to the trained score than plain Hamming,
and it has 4 * bits + 1 values instead of bits + 1 (fewer ties at the budget's threshold). Same
auxiliary memory per key. ``hashattention-w2`` uses weights 1..2 (one bit-plane in a kernel).
"""

from __future__ import annotations

import hashlib
import os

import torch

from ... import ops
from ...adapters import CONFIG_NAME, WEIGHTS_NAME, HashAdapters
from .base import Selector, SelectorUnavailable
from .signature_cache import cached_key_signatures


class HashAttentionSelector(Selector):
    name = "hashattention"
    variants = {"": {"selection": "query"}, "-group": {"selection": "kv"},
                "-w2": {"selection": "query", "query_levels": 2}, "-w4": {"selection": "query", "query_levels": 4}}

    def __init__(self, selection: str = "query", query_levels: int = 0):
        super().__init__()
        if selection not in ("query", "kv"):
            raise ValueError(f"selection must be 'query' or 'kv', got {selection!r}")
        if not isinstance(query_levels, int) or query_levels < 0:
            raise ValueError(f"query_levels must be a non-negative int (0: plain Hamming), got {query_levels!r}")
        if query_levels and selection != "query":
            raise ValueError("query_levels needs selection='query'")
        self.selection = selection
        self.query_levels = query_levels
        self.adapters = None

    def prepare(self, setup):
        super().prepare(setup)
        directory = setup.adapters_dir
        if self.selection == "kv" and getattr(setup, "group_adapters_dir", None):
            directory = setup.group_adapters_dir
        if not directory or not os.path.isfile(os.path.join(directory, CONFIG_NAME)):
            raise SelectorUnavailable(f"no trained adapters found at {directory!r}")
        adapters = HashAdapters.from_pretrained(directory, dtype=torch.float32).eval()
        config = adapters.config
        expected = (setup.shape.num_layers, setup.shape.num_query_heads, setup.shape.num_kv_heads, setup.shape.head_dim)
        found = (config.num_layers, config.num_query_heads, config.num_kv_heads, config.head_dim)
        if expected != found:
            raise SelectorUnavailable(
                f"adapters at {directory} are for (layers, q heads, kv heads, head_dim) = {found}, model has {expected}"
            )
        self.adapters = adapters
        with open(os.path.join(directory, WEIGHTS_NAME), "rb") as f:
            self.weights_sha256 = hashlib.sha256(f.read()).hexdigest()

    def identity(self):
        identity = {**super().identity(), "adapters_sha256": getattr(self, "weights_sha256", None)}
        if self.query_levels:
            identity["query_levels"] = self.query_levels
        return identity

    def aux_bits_per_token(self, shape):
        if self.adapters is None:
            return None
        config = self.adapters.config
        return float(config.bits * config.num_key_signature_heads)

    def select(self, layer, query, key, value, budget, scaling):
        adapter = self.adapters[layer]
        if self.query_levels:
            return self._select_weighted(adapter, layer, query, key, budget)
        key_signatures = cached_key_signatures(self.state, layer, key, adapter.key_signatures)
        return ops.hamming_topk(
            adapter.query_signatures(query),
            key_signatures,
            selection_heads=self.selection_heads(self.shape),
            sink_tokens=budget.sink_tokens,
            local_tokens=budget.local_tokens,
            budget_tokens=budget.heavy_tokens,
        )

    def _select_weighted(self, adapter, layer, query, key, budget):
        # The same cached key signatures as plain Hamming, unpacked to +-1 (B, Hq, N, bits).
        key_bits = ops.unpack_signs(cached_key_signatures(self.state, layer, key, adapter.key_signatures))
        key_signs = torch.where(key_bits, 1.0, -1.0)
        codes = adapter.query(query.float())  # (B, Hq, P, bits)
        weights = query_bit_weights(codes, self.query_levels) * torch.where(codes > 0, 1.0, -1.0)
        scores = torch.matmul(weights, key_signs.transpose(-1, -2))  # integers, exact in float32
        return ops.topk_from_scores(scores, sink_tokens=budget.sink_tokens, local_tokens=budget.local_tokens,
                                   budget_tokens=budget.heavy_tokens)


def query_bit_weights(codes: torch.Tensor, levels: int) -> torch.Tensor:
    """Per-bit weights in ``1..levels`` (float) of pre-sign query codes ``(..., bits)``.

    ``w_j = clamp(ceil(levels * |tanh(c_j)| / max_i |tanh(c_i)|), 1, levels)``: the row's surest bit
    weighs ``levels``, bits within ``1/levels`` of zero weigh 1.
    """
    magnitude = torch.tanh(codes).abs()
    scale = magnitude.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(magnitude.dtype).tiny)
    return torch.ceil(magnitude / scale * levels).clamp(1, levels)
