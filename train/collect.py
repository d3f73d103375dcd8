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
from typing import Dict, List, Optional, Sequence

import torch
from tqdm import tqdm

from hashattention.corpus import corpus_files

from .checkpoint import atomic_write
from .config import TrainConfig, setting_differences
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


# Collection settings that fit and validate apply themselves (labels, windows, recall's k), so they may
# differ there from the values the shards were collected with.
APPLIED_AFTER_COLLECTION = ("sink_tokens", "local_tokens", "top_k")


def manifest_path(config: TrainConfig) -> str:
    return os.path.join(config.work_dir, "shards", "manifest.json")


def check_manifest(config: TrainConfig, ignore: Sequence[str] = ()) -> None:
    """Refuse settings that differ from those the shards of ``config.work_dir`` were collected with
    (nothing to compare before the first collection). The error names each differing setting with
    both values; ``ignore``: settings not compared."""
    path = manifest_path(config)
    if not os.path.exists(path):
        return
    with open(path) as f:
        found = {**COLLECTION_FIELD_DEFAULTS, **json.load(f)}
    wanted = {name: getattr(config, name) for name in COLLECTION_FIELDS if name not in ignore}
    differences = setting_differences(found, wanted, "shards", "requested")
    if differences:
        raise ValueError(f"the shards in {os.path.dirname(path)} were collected with other settings: "
                         + "; ".join(differences) + ". Use the shards' values or another --work-dir")


def record_manifest(config: TrainConfig) -> None:
    """Write the collection settings into ``shards/manifest.json`` unless it exists."""
    path = manifest_path(config)
    if not os.path.exists(path):
        settings = {name: getattr(config, name) for name in COLLECTION_FIELDS}
        atomic_write(path, lambda p: open(p, "w").write(json.dumps(settings, indent=2) + "\n"))


def require_shards(config: TrainConfig, split: str) -> List[str]:
    """The shard paths of ``split`` once they are all there and were collected with ``config``'s settings;
    else a ValueError that says what to run."""
    paths = shard_paths(config, split)
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        count = "train_sequences" if split == "train" else "validation_sequences"
        raise ValueError(
            f"{len(missing)} of the {len(paths)} {split} shards ({count} = {len(paths)}) are missing from "
            f"{os.path.join(config.work_dir, 'shards', split)}: run `python -m train collect` (or `run`) "
            f"with --work-dir {config.work_dir} and the same settings first")
    check_manifest(config, ignore=APPLIED_AFTER_COLLECTION)
    return paths


def check_collection_inputs(config: TrainConfig) -> None:
    """What collection reads, checked before the model loads: the corpus folder, the model's
    config (``layers`` and the positions a sequence reaches)."""
    from .model import check_model_settings, load_model_config

    if config.dataset == "local":
        corpus_files(config.corpus)  # a ValueError naming the folder when it holds no text
    check_model_settings(config, load_model_config(config))


def collect(config: TrainConfig, context: DistributedContext) -> None:
    """Write the missing train and validation shards; sequences are split round-robin over ranks."""
    global _active_recorder
    from safetensors.torch import save_file

    # Every rank checks (a rank that failed alone would leave the others waiting at a barrier), and
    # before the manifest is written, so that a refused setting is not recorded.
    check_manifest(config)
    missing = [(split, index) for split in ("train", "validation")
               for index, path in enumerate(shard_paths(config, split)) if not os.path.exists(path)]
    if missing:
        check_collection_inputs(config)
    if context.is_main:
        record_manifest(config)
    context.barrier()
    todo = [(split, index) for split, index in missing if index % context.world_size == context.rank]
    if not todo:
        log.info("collect: all shards present, nothing to do")
        context.barrier()
        return
    model, tokenizer = _load_for_capture(config)
    model.to(context.device)
    sequences = {split: token_sequences(config, tokenizer, split,
                                        config.train_sequences if split == "train" else config.validation_sequences)
                 for split in {s for s, _ in todo}}
    for split, index in todo:  # facts that do not fit fail here, before the first forward pass
        if split == "train":  # validation stays prose: held-out recall comparable across recipes
            sequences[split][index] = add_retrieval_facts(config, tokenizer, sequences[split][index], index)
    dtype = getattr(torch, config.shard_dtype)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for split, index in tqdm(todo, desc=f"collect[rank {context.rank}]", disable=not context.is_main):
        positions = sample_query_positions(config, split, index)
        recorder = Recorder(positions, dtype)
        _active_recorder = recorder
        tokens = sequences[split][index][None].to(context.device)
        offset = sequence_position_offset(config, split, index)
        position_ids = torch.arange(offset, offset + tokens.shape[1], device=context.device)[None]
        try:
            with torch.no_grad():
                # The decoder alone: the LM head (the largest matmul of a small model) is not needed.
                base(input_ids=tokens, position_ids=position_ids, use_cache=False)
        finally:
            _active_recorder = None
        tensors = {"query_positions": positions, **{name: t.cpu() for name, t in recorder.tensors.items()}}
        metadata = {"split": split, "index": str(index), "position_offset": str(offset)}
        atomic_write(shard_path(config, split, index), lambda p: save_file(tensors, p, metadata))
        log.info("collect: wrote %s", shard_path(config, split, index))
    context.barrier()


def _load_for_capture(config: TrainConfig):
    from .model import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(config)
    model.set_attn_implementation(register_capturing_attention())
    return model, tokenizer
