"""Load the frozen model and tokenizer a run collects from."""

from __future__ import annotations

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
