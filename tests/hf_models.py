"""Tiny random-weight Llama / Mistral models and a plain-PyTorch oracle of the patched attention.

The oracle (:func:`reference_attention`) recomputes everything from scratch with no cache:
float64 signatures from the adapters' weights (``reference.encode_signatures``), the
reference selection (``reference.hamming_topk``) turned into a boolean mask, and masked
softmax attention in float64. It shares no code with the ops or with the integration.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from hashattention import reference
from hashattention.adapters import HashAdapters
from hashattention.config import HashAttentionConfig

VOCAB = 96
PAD = 0


def tiny_model(kind: str = "llama", seed: int = 0, layers: int = 2):
    """A 2-layer model: 4 query heads, 2 KV heads (GQA 2), head_dim 64, float32, eval mode."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=None, **common))
    else:
        raise ValueError(kind)
    # Random init gives near-uniform attention; sharper attention makes the selection matter.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None  # random weights: never stop early, compare whole generations
    return model.eval()


def tiny_adapters(model, seed: int = 1, key_heads: str = "query") -> HashAdapters:
    torch.manual_seed(seed)
    return HashAdapters.for_model_config(model.config, key_heads=key_heads, hidden_features=(32,)).eval()


def random_ids(batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


# ----------------------------------------------------------------------------- the oracle

REFERENCE_NAME = "hashattention_test_reference"
_ORACLE = {}


def left_padded_batch(lengths, seed):
    """Random rows of the given lengths, left-padded with PAD: (rows, ids (B, max), 0/1 mask (B, max))."""
    rows = [random_ids(1, n, seed + i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return rows, ids, mask


def configure_reference(adapters: HashAdapters, config: HashAttentionConfig, sparse_from: int) -> None:
    """Rows at positions ``>= sparse_from`` (in cache coordinates) run sparse; earlier ones dense."""
    _ORACLE.update(adapters=adapters, config=config, sparse_from=sparse_from)


def reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Full-sequence (no cache) attention: dense causal rows, then the HashAttention selection as a mask."""
    adapters, config, sparse_from = _ORACLE["adapters"], _ORACLE["config"], _ORACLE["sparse_from"]
    adapter = adapters[module.layer_idx]
    batch, q_heads, rows, _ = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    assert rows == keys, "the oracle runs without a cache"
    # Left padding from the boolean SDPA mask (None: no padding).
    if attention_mask is None:
        starts = torch.zeros(batch, dtype=torch.int64)
    else:
        starts = attention_mask[:, 0, -1, :].long().argmax(-1)
    position = torch.arange(keys)
    causal = (position[None, :] <= position[:, None])[None, None]  # (1, 1, L, N)
    visible = causal & (position[None, None, None, :] >= starts[:, None, None, None])

    mlp_q, mlp_k = adapter.query, adapter.key
    q_sig = reference.encode_signatures(query, list(mlp_q.weights), list(mlp_q.biases), mlp_q.activation)
    k_sig = reference.encode_signatures(adapter.expand_keys(key), list(mlp_k.weights), list(mlp_k.biases), mlp_k.activation)
    selection_heads = q_heads if config.selection == "query_head" else kv_heads
    indices, counts = reference.hamming_topk(
        q_sig,
        k_sig,
        selection_heads=selection_heads,
        sink_tokens=config.sink_tokens,
        local_tokens=config.local_tokens,
        budget_tokens=config.budget_tokens - config.window_tokens,
        start_positions=starts.to(torch.int32),
    )
    selected = torch.zeros(batch, selection_heads, rows, keys + 1, dtype=torch.bool)
    selected.scatter_(-1, torch.where(indices < 0, keys, indices).long(), True)
    selected = selected[..., :keys].repeat_interleave(q_heads // selection_heads, dim=1)
    sparse_row = (position >= sparse_from)[None, None, :, None]
    allowed = torch.where(sparse_row, selected, visible.expand(batch, q_heads, rows, keys))

    k = key.double().repeat_interleave(q_heads // kv_heads, dim=1)
    v = value.double().repeat_interleave(q_heads // kv_heads, dim=1)
    logits = torch.einsum("bhld,bhnd->bhln", query.double(), k) * scaling
    logits = logits.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # padding rows see nothing
    out = (weights @ v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(REFERENCE_NAME, reference_attention)
AttentionMaskInterface.register(REFERENCE_NAME, sdpa_mask)
