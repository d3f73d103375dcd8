"""``patch`` checks the model, the adapters and the config before it changes anything, and does not stack."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hashattention.config import HashAttentionConfig
from hashattention.patching import decoder_layers, is_patched, patch, unpatch

from hf_models import random_ids, tiny_adapters, tiny_model

CONFIG = HashAttentionConfig(sink_tokens=2, local_tokens=2, budget_tokens=8, sparse_prompt_tokens=16)


def assert_untouched(model, adapters=None):
    """Nothing of a failed patch is left: no state, no hooks, SDPA still selected, adapters where they were."""
    assert not is_patched(model)
    assert model.config._attn_implementation == "sdpa"
    assert all(not layer.self_attn._forward_pre_hooks for layer in decoder_layers(model))
    if adapters is not None:
        assert all(p.device.type == "cpu" for p in adapters.parameters())


def test_patch_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="num_kv_heads"):
        other = tiny_model("llama")
        other.config.num_key_value_heads = 4
        patch(model, tiny_adapters(other))
    with pytest.raises(ValueError, match="dense_layers"):
        patch(model, tiny_adapters(model), HashAttentionConfig(dense_layers=[5]))
    with pytest.raises(ValueError, match="bits"):
        patch(model, tiny_adapters(model), HashAttentionConfig(bits=64))
    mistral = tiny_model("mistral")
    mistral.config.sliding_window = 4096
    with pytest.raises(ValueError, match="sliding_window"):
        patch(mistral, tiny_adapters(mistral))
    assert not is_patched(model) and not is_patched(mistral)
    assert_untouched(model)


@pytest.mark.parametrize("head_dim", [32, 96])
def test_unsupported_head_dim_is_refused_at_patch(head_dim):
    """The kernels take head dims 64, 128 and 256: any other fails at patch, not at the first forward."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=2 * head_dim, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=head_dim)).eval()
    adapters = tiny_adapters(model)
    with pytest.raises(ValueError, match=f"head_dim is {head_dim}; the sparse attention kernels support \\(64, 128, 256\\)"):
        patch(model, adapters, CONFIG)
    assert_untouched(model, adapters)


def test_unsupported_model_dtype_is_refused_at_patch():
    model = tiny_model("llama").double()
    with pytest.raises(ValueError, match="dtype is torch.float64"):
        patch(model, tiny_adapters(model), CONFIG)
    assert_untouched(model)


def per_kv_head_keys(adapters):
    adapters.config.key_heads = "kv"  # the key weights stay one per query head


def wider_signatures(adapters):
    adapters.config.bits = 64


def narrower_hidden_layer(adapters):
    adapters.layers[1].query.weights[0].data = torch.zeros(4, 64, 16)


def extra_layer(adapters):
    adapters.layers.append(adapters.layers[0])


def float8_key_stack(adapters):
    adapters.layers[0].key.to(torch.float8_e4m3fn)


@pytest.mark.parametrize("edit, message", [
    (per_kv_head_keys, "layer 0 key weights have shapes .* key_heads = 'kv'"),
    (wider_signatures, "layer 0 query weights have shapes .* bits 64"),
    (narrower_hidden_layer, "layer 1 query weights have shapes"),
    (extra_layer, "adapters hold 3 layers"),
    (float8_key_stack, "layer 0 key parameters are torch.float8_e4m3fn"),
])
def test_adapters_that_do_not_match_their_config_are_refused_at_patch(edit, message):
    """Adapters whose tensors disagree with their config (edited after construction) fail at patch."""
    model = tiny_model("llama")
    adapters = tiny_adapters(model)
    edit(adapters)
    with pytest.raises(ValueError, match=message):
        patch(model, adapters, CONFIG)
    assert_untouched(model)


def test_nested_patch_raises_and_the_block_restores_the_model():
    """A second patch on a patched model raises; leaving the block leaves the model exactly as before."""
    model = tiny_model("llama")
    ids = random_ids(1, 24, seed=4)
    adapters = tiny_adapters(model)
    other = HashAttentionConfig(sink_tokens=1, local_tokens=1, budget_tokens=4, sparse_prompt_tokens=16)
    with torch.no_grad():
        before = model(ids).logits
        with patch(model, adapters, CONFIG) as handle:
            patched = model(ids).logits
            with pytest.raises(ValueError, match="already patched with HashAttention; unpatch first"):
                patch(model, adapters, other)
            assert model._hashattention_patch is handle  # the failed patch changed nothing
            torch.testing.assert_close(model(ids).logits, patched, atol=0, rtol=0)
        assert_untouched(model)
        assert torch.equal(model(ids).logits, before)

        # Changing the config: unpatch, then patch again.
        patch(model, adapters, CONFIG)
        unpatch(model)
        with patch(model, adapters, other):
            changed = model(ids).logits
        assert_untouched(model)
    assert (changed - patched).abs().max() > 1e-4


def test_float64_adapters_are_encoded_as_float32():
    """float64 adapters (e.g. after ``.double()``) patch and give the float32 adapters' outputs."""
    model = tiny_model("llama")
    ids = random_ids(1, 24, seed=7)
    adapters = tiny_adapters(model)
    with torch.no_grad():
        with patch(model, adapters, CONFIG):
            want = model(ids).logits
        with patch(model, tiny_adapters(model).double(), CONFIG):
            got = model(ids).logits
    assert torch.equal(got, want)
