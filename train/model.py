"""Load the frozen model and tokenizer a run collects from, or only its config (to check settings first)."""

from __future__ import annotations

import os

import torch

from .config import TrainConfig
from .data import ByteTokenizer


def load_model_and_tokenizer(config: TrainConfig):
    """``(model, tokenizer)`` in eval mode, fp32, no gradients.

    ``config.model == "smollm2"`` loads the offline SmolLM2-135M-Instruct GGUF
    (:func:`hashattention.offline_model.load_smollm2`); anything else is a local Hugging Face directory.
    ``config.tokenizer == "bytes"`` replaces the tokenizer by :class:`ByteTokenizer`.
    """
    if config.model == "smollm2":
        from hashattention.offline_model import MODEL_NAME, load_smollm2

        model, tokenizer = load_smollm2(dtype=torch.float32)
        model.config._name_or_path = MODEL_NAME
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.float32).eval()
        tokenizer = None
        if config.tokenizer != "bytes":
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(config.model)
    if config.tokenizer == "bytes":
        tokenizer = ByteTokenizer(model.config.vocab_size)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model, tokenizer


def load_model_config(config: TrainConfig):
    """The transformers config of ``config.model``, read without its weights (seconds, not the model's load).

    Raises a ValueError when ``config.model`` is neither ``"smollm2"`` nor a model directory.
    """
    from transformers import AutoConfig

    if config.model == "smollm2":
        from hashattention.offline_model import smollm2_config

        return smollm2_config()
    if not os.path.isfile(os.path.join(config.model, "config.json")):
        raise ValueError(f"TrainConfig.model must be 'smollm2' or a Hugging Face model directory (with a config.json), "
                         f"got {config.model!r}")
    return AutoConfig.from_pretrained(config.model)


def check_model_settings(config: TrainConfig, model_config) -> None:
    """The settings that depend on the model, checked against its config: ``layers`` exist, and the
    positions a sequence runs at (up to ``max_position_offset + sequence_tokens - 1``) are within
    the model's ``max_position_embeddings``."""
    config.selected_layers(model_config.num_hidden_layers)
    limit = getattr(model_config, "max_position_embeddings", None)
    reach = config.sequence_tokens + config.max_position_offset
    if limit is not None and reach > limit:
        raise ValueError(
            f"TrainConfig.sequence_tokens ({config.sequence_tokens}) + max_position_offset ({config.max_position_offset}) "
            f"= {reach} positions exceed the model's max_position_embeddings ({limit})")
