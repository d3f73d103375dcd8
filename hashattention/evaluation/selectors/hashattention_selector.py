"""HashAttention (Desai et al., 2025): learned 32-bit signatures, Hamming top-k.

Loads trained :class:`~hashattention.adapters.HashAdapters` (``save_pretrained`` layout).
``hashattention`` selects per query head, as in the paper; ``hashattention-group`` shares one
selection per KV group (the Hamming scores of the group's query heads are summed), reading
the group-shared adapters when given (``SelectorSetup.group_adapters_dir``), else the same
adapters. Key signatures are encoded once per key, when the key first appears.
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
    variants = {"": {"selection": "query"}, "-group": {"selection": "kv"}}

    def __init__(self, selection: str = "query"):
        super().__init__()
        if selection not in ("query", "kv"):
            raise ValueError(f"selection must be 'query' or 'kv', got {selection!r}")
        self.selection = selection
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
        return {**super().identity(), "adapters_sha256": getattr(self, "weights_sha256", None)}

    def aux_bits_per_token(self, shape):
        if self.adapters is None:
            return None
        config = self.adapters.config
        return float(config.bits * config.num_key_signature_heads)

    def select(self, layer, query, key, value, budget, scaling):
        adapter = self.adapters[layer]
        key_signatures = cached_key_signatures(self.state, layer, key, adapter.key_signatures)
        return ops.hamming_topk(
            adapter.query_signatures(query),
            key_signatures,
            selection_heads=self.selection_heads(self.shape),
            sink_tokens=budget.sink_tokens,
            local_tokens=budget.local_tokens,
            budget_tokens=budget.heavy_tokens,
        )
