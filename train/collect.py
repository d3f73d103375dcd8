"""Capture post-RoPE queries and keys of every layer from the frozen model and write them as shards.

The capture goes through transformers' ``AttentionInterface``: a registered attention function
(:func:`capturing_attention`) receives exactly what the model's attention would get — post-RoPE
queries ``(B, Hq, L, D)`` and keys/values ``(B, Hkv, N, D)`` — records them, then runs SDPA, so
nothing is recomputed by hand and the model's outputs are unchanged.

One shard per sequence: ``<work_dir>/shards/<split>/<index>.safetensors`` with

* ``query_positions``: int64 ``(Q,)`` sampled positions (sorted; all >= ``first_query_position``),
* ``layer.<L>.queries``: ``(Hq, Q, D)`` queries at those positions,
* ``layer.<L>.keys``: ``(Hkv, N, D)`` all keys of the sequence,
* ``layer.<L>.value_norms``: fp32 ``(Hkv, N)`` ‖v‖ (for the ``qk_log_value_norm`` target).

Shards are written atomically and existing ones are kept, so an interrupted collection resumes.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Dict, List, Optional

import torch
from tqdm import tqdm

from .checkpoint import atomic_write
from .config import TrainConfig
from .data import token_sequences
from .distributed import DistributedContext
from .retrieval_facts import add_retrieval_facts

log = logging.getLogger(__name__)

ATTENTION_NAME = "hashattention_capture"
SPLIT_SEED_OFFSET = {"train": 0, "validation": 1_000_000}
_active_recorder: Optional["Recorder"] = None


class Recorder:
    """Holds the tensors of one forward pass; ``positions`` are the query rows to keep."""

    def __init__(self, positions: torch.Tensor, dtype: torch.dtype):
        self.positions = positions
        self.dtype = dtype
        self.tensors: Dict[str, torch.Tensor] = {}

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.shape[0] != 1:
            raise ValueError(f"collection runs one sequence at a time, got a batch of {query.shape[0]}")
        self.tensors[f"layer.{layer}.queries"] = query[0, :, self.positions].to(self.dtype).contiguous()
        self.tensors[f"layer.{layer}.keys"] = key[0].to(self.dtype).contiguous()
        self.tensors[f"layer.{layer}.value_norms"] = value[0].float().norm(dim=-1).contiguous()


def capturing_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA attention that first hands q/k/v to the active :class:`Recorder` (if any)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _active_recorder is not None:
        _active_recorder.record(module.layer_idx, query, key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_capturing_attention() -> str:
    """Register the capture function and SDPA's mask function under :data:`ATTENTION_NAME`."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, capturing_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


def sample_query_positions(config: TrainConfig, split: str, index: int) -> torch.Tensor:
    """Sorted int64 ``(queries_per_sequence,)`` distinct positions in ``[first_query_position, sequence_tokens)``,
    a pure function of (seed, split, index)."""
    generator = torch.Generator().manual_seed(config.seed * 7_919 + SPLIT_SEED_OFFSET[split] + index)
    first = config.first_query_position
    picked = torch.randperm(config.sequence_tokens - first, generator=generator)[: config.queries_per_sequence]
    return (picked + first).sort().values


def sequence_position_offset(config: TrainConfig, split: str, index: int) -> int:
    """Position of a sequence's first token, in ``[0, max_position_offset]``; a pure function of (seed, split, index)."""
    if config.max_position_offset == 0:
        return 0
    generator = torch.Generator().manual_seed(config.seed * 104_729 + SPLIT_SEED_OFFSET[split] * 31 + index)
    return int(torch.randint(0, config.max_position_offset + 1, (1,), generator=generator))


def shard_path(config: TrainConfig, split: str, index: int) -> str:
    return os.path.join(config.work_dir, "shards", split, f"{index:05d}.safetensors")


def shard_paths(config: TrainConfig, split: str) -> List[str]:
    count = config.train_sequences if split == "train" else config.validation_sequences
    return [shard_path(config, split, i) for i in range(count)]


COLLECTION_FIELDS = ("model", "tokenizer", "dataset", "corpus", "validation_modulus", "document_tokens", "sequence_tokens",
                     "queries_per_sequence", "query_start_fraction", "shard_dtype", "seed", "sink_tokens",
                     "local_tokens", "top_k", "max_position_offset", "retrieval_facts", "retrieval_fact_style")
# Fields a manifest may lack, with the value its absence means.
COLLECTION_FIELD_DEFAULTS = {"max_position_offset": 0, "retrieval_facts": 0, "retrieval_fact_style": "repeat"}


def _check_manifest(config: TrainConfig) -> None:
    """Refuse to mix shards collected with different settings in one work_dir."""
    path = os.path.join(config.work_dir, "shards", "manifest.json")
    wanted = {name: getattr(config, name) for name in COLLECTION_FIELDS}
    if os.path.exists(path):
        with open(path) as f:
            found = {**COLLECTION_FIELD_DEFAULTS, **json.load(f)}
        if found != json.loads(json.dumps(wanted)):
            raise ValueError(f"{path} was written with other collection settings {found}; use another work_dir")
    else:
        atomic_write(path, lambda p: open(p, "w").write(json.dumps(wanted, indent=2) + "\n"))


def collect(config: TrainConfig, context: DistributedContext) -> None:
    """Write the missing train and validation shards; sequences are split round-robin over ranks."""
    global _active_recorder
    from safetensors.torch import save_file

    os.makedirs(os.path.join(config.work_dir, "shards"), exist_ok=True)
    if context.is_main:
        _check_manifest(config)
    context.barrier()
    todo = []
    for split in ("train", "validation"):
        for index, path in enumerate(shard_paths(config, split)):
            if index % context.world_size == context.rank and not os.path.exists(path):
                todo.append((split, index))
    if not todo:
        log.info("collect: all shards present, nothing to do")
        context.barrier()
        return
    model, tokenizer = _load_for_capture(config)
    sequences = {split: token_sequences(config, tokenizer, split,
                                        config.train_sequences if split == "train" else config.validation_sequences)
                 for split in {s for s, _ in todo}}
    dtype = getattr(torch, config.shard_dtype)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for split, index in tqdm(todo, desc=f"collect[rank {context.rank}]", disable=not context.is_main):
        positions = sample_query_positions(config, split, index)
        recorder = Recorder(positions, dtype)
        _active_recorder = recorder
        tokens = sequences[split][index]
        if split == "train":  # validation stays prose: held-out recall comparable across recipes
            tokens = add_retrieval_facts(config, tokenizer, tokens, index)
        tokens = tokens[None]
        offset = sequence_position_offset(config, split, index)
        position_ids = torch.arange(offset, offset + tokens.shape[1])[None]
        try:
            with torch.no_grad():
                # The decoder alone: the LM head (the largest matmul of a small model) is not needed.
                base(input_ids=tokens, position_ids=position_ids, use_cache=False)
        finally:
            _active_recorder = None
        tensors = {"query_positions": positions, **recorder.tensors}
        metadata = {"split": split, "index": str(index), "position_offset": str(offset)}
        atomic_write(shard_path(config, split, index), lambda p: save_file(tensors, p, metadata))
        log.info("collect: wrote %s", shard_path(config, split, index))
    context.barrier()


def _load_for_capture(config: TrainConfig):
    from .model import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(config)
    model.set_attn_implementation(register_capturing_attention())
    return model, tokenizer
