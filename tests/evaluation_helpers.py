"""Shared pieces of the evaluation tests: a tiny byte-level Llama, a tiny corpus, brute-force selection."""

from __future__ import annotations

import os
import random
import zlib

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hashattention.evaluation.selectors import ModelShape

WORDS = (
    "amber basil cedar delta ember fable garnet harbor island jasper kernel lantern meadow nectar orchard pepper "
    "quartz ribbon saddle timber umber velvet willow xenon yonder zephyr anchor bramble candle dapple"
).split()


def tiny_model(seed: int = 0, layers: int = 2) -> LlamaForCausalLM:
    """2 layers, 4 query heads, 2 KV heads, head_dim 64, vocab 260 (bytes + EOS 256), float32, eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=260, hidden_size=256, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, bos_token_id=1, eos_token_id=256,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper attention than the random init, so selection matters
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model.eval()


def tiny_shape() -> ModelShape:
    return ModelShape(num_layers=2, num_query_heads=4, num_kv_heads=2, head_dim=64)


def tiny_corpus(directory: str, modulus: int = 2) -> str:
    """Six files of random sentences, named so that both splits of ``crc32(name) % modulus`` are non-empty."""
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(0)
    names = [f"doc{i}.txt" for i in range(40)]
    held = [n for n in names if zlib.crc32(n.encode()) % modulus == 0][:3]
    rest = [n for n in names if zlib.crc32(n.encode()) % modulus != 0][:3]
    for name in held + rest:
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + "."
                     for _ in range(300)]
        with open(os.path.join(directory, name), "w") as f:
            f.write(" ".join(sentences))
    return directory


def brute_force_select(scores: torch.Tensor, sink: int, local: int, heavy: int):
    """Sets of positions per (b, s, row): the budget contract written as plain loops.

    Row ``l`` of ``P`` sits at ``N - P + l``; sink ``[0, sink)``, local the latest ``local``
    positions up to the row, then the ``heavy`` best remaining by score (ties to the later position).
    """
    batch, heads, rows, keys = scores.shape
    out = {}
    for b in range(batch):
        for s in range(heads):
            for l in range(rows):
                p = keys - rows + l
                chosen = {j for j in range(min(sink, p + 1))}
                chosen |= {j for j in range(max(p - local + 1, 0), p + 1)}
                rest = [j for j in range(p + 1) if j not in chosen]
                rest.sort(key=lambda j: (float(scores[b, s, l, j]), j), reverse=True)
                chosen |= set(rest[:heavy])
                out[(b, s, l)] = chosen
    return out


def selected_sets(indices: torch.Tensor, counts: torch.Tensor):
    batch, heads, rows, _ = indices.shape
    return {
        (b, s, l): set(indices[b, s, l, : counts[b, s, l]].tolist())
        for b in range(batch) for s in range(heads) for l in range(rows)
    }
