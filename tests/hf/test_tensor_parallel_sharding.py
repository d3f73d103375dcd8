"""The tensor-parallel sharding rule on one process: which heads a rank owns and its slice of the adapters."""

import pytest
import torch
from transformers import LlamaConfig

from hashattention.adapters import HashAdapters
from hashattention.patching import decoder_layers, patch
from hashattention.tensor_parallel import HeadShard, adapters_for_shard, head_shard, shard_adapters

from hf_models import tiny_adapters, tiny_model

QUERY_HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64


def full_adapters(key_heads: str, seed: int = 0) -> HashAdapters:
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=QUERY_HEADS * HEAD_DIM, num_attention_heads=QUERY_HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_hidden_layers=2)
    return HashAdapters.for_model_config(config, key_heads=key_heads, hidden_features=(32,)).eval()


def test_head_ranges_are_contiguous_per_rank():
    shard = HeadShard(rank=1, world_size=4, num_query_heads=32, num_kv_heads=8)
    assert (shard.local_query_heads, shard.local_kv_heads) == (8, 2)
    assert shard.query_heads == range(8, 16) and shard.kv_heads == range(2, 4)
    assert shard.key_signature_heads("query") == range(8, 16) and shard.key_signature_heads("kv") == range(2, 4)


@pytest.mark.parametrize("world_size, name", [(3, "num_attention_heads \\(32\\)"), (16, "num_key_value_heads \\(8\\)")])
def test_head_counts_must_divide_by_the_tensor_parallel_size(world_size, name):
    with pytest.raises(ValueError, match=f"{name} to be divisible by the tensor-parallel size \\({world_size}\\)"):
        HeadShard(rank=0, world_size=world_size, num_query_heads=32, num_kv_heads=8)
    with pytest.raises(ValueError, match="rank must be in \\[0, 2\\)"):
        HeadShard(rank=2, world_size=2, num_query_heads=32, num_kv_heads=8)


@pytest.mark.parametrize("key_heads", ["query", "kv"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_rank_slice_encodes_its_heads_as_the_full_adapters_do(key_heads, world_size):
    adapters = full_adapters(key_heads)
    torch.manual_seed(1)
    query = torch.randn(2, QUERY_HEADS, 5, HEAD_DIM)
    key = torch.randn(2, KV_HEADS, 7, HEAD_DIM)
    for rank in range(world_size):
        shard = HeadShard(rank, world_size, QUERY_HEADS, KV_HEADS)
        sliced = shard_adapters(adapters, shard)
        assert (sliced.config.num_query_heads, sliced.config.num_kv_heads) == (QUERY_HEADS // world_size,
                                                                              KV_HEADS // world_size)
        assert sliced.config.key_heads == key_heads
        key_signature_heads = list(shard.key_signature_heads(key_heads))
        for full, local in zip(adapters.layers, sliced.layers):
            local_query = query[:, shard.query_heads.start : shard.query_heads.stop]
            local_key = key[:, shard.kv_heads.start : shard.kv_heads.stop]
            assert torch.equal(local.query_signatures(local_query),
                               full.query_signatures(query)[:, shard.query_heads.start : shard.query_heads.stop])
            assert torch.equal(local.key_signatures(local_key), full.key_signatures(key)[:, key_signature_heads])


def test_a_slice_keeps_dtypes_and_is_a_copy():
    adapters = full_adapters("query").half()
    adapters.layers[1].key.biases[0].data = adapters.layers[1].key.biases[0].data.float()  # mixed dtypes survive
    sliced = shard_adapters(adapters, HeadShard(1, 2, QUERY_HEADS, KV_HEADS))
    assert sliced.layers[0].query.weights[0].dtype == torch.float16
    assert sliced.layers[1].key.biases[0].dtype == torch.float32
    assert all(p.device.type == "cpu" for p in sliced.parameters())
    expected = adapters.layers[0].query.weights[1][4:].clone()
    with torch.no_grad():
        adapters.layers[0].query.weights[1].zero_()
    assert torch.equal(sliced.layers[0].query.weights[1], expected)


def test_full_adapters_are_sliced_a_rank_slice_is_kept_and_others_are_refused():
    adapters = full_adapters("kv")
    shard = HeadShard(0, 2, QUERY_HEADS, KV_HEADS)
    sliced = adapters_for_shard(adapters, shard)
    assert sliced is not adapters and sliced.config.num_query_heads == 4
    assert adapters_for_shard(sliced, shard) is sliced
    wrong = HashAdapters.for_model_config(LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=8,
                                                      head_dim=64, num_hidden_layers=2))
    with pytest.raises(ValueError, match="adapters.config has 8 query / 8 KV heads; pass the full adapters "
                                         "\\(8 / 4, sliced per rank by patch\\) or this rank's slice \\(4 / 2\\)"):
        adapters_for_shard(wrong, shard)
    with pytest.raises(ValueError, match="shard_adapters: adapters.config has 4 query / 2 KV heads"):
        shard_adapters(sliced, shard)


def test_one_process_is_not_sharded_and_patch_runs_the_given_adapters():
    model = tiny_model("llama")
    adapters = tiny_adapters(model)
    assert head_shard([layer.self_attn for layer in decoder_layers(model)], 4, 2) is None
    with patch(model, adapters) as handle:
        assert handle.shard is None and handle.adapters is adapters
