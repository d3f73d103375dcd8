"""Shared helpers of the training tests: a tiny random-weight Llama model on disk and tiny-run flags."""

from __future__ import annotations

import os
import sys

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE_CORPUS = os.path.join(REPO_ROOT, "train", "sample_corpus")


def write_tiny_llama(directory: str, seed: int = 0) -> str:
    """A 2-layer Llama (4 query heads, 2 KV heads, head_dim 16, vocab 256) saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def tiny_run_flags(model_dir: str, work_dir: str, **overrides) -> list:
    """CLI flags of a seconds-long run on the tiny model and the shipped sample corpus."""
    flags = {
        "model": model_dir, "tokenizer": "bytes", "corpus": SAMPLE_CORPUS, "sequence-tokens": 192,
        "train-sequences": 3, "validation-sequences": 2, "queries-per-sequence": 16, "top-k": 8,
        "sink-tokens": 4, "local-tokens": 4, "hidden-features": 16, "epochs": 2, "checkpoint-every": 2,
        "threads": 1, "work-dir": work_dir,
    }
    flags.update(overrides)
    out = []
    for name, value in flags.items():
        out.append("--" + name)
        out.extend(str(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return out


def subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


PYTHON = sys.executable
