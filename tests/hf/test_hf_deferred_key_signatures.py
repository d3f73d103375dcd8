"""Static caches defer encoding appended keys: one encode_pair_and_select call per sparse layer and
decode step (it encodes the query and the new keys, stores the keys and selects), with the same logits
as encoding the keys in ``update`` and a complete signature cache."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, StaticCache

import hashattention as ha
from hashattention.cache import SignatureStaticLayer
from hashattention.config import HashAttentionConfig
from hashattention.patching import patch

from hf_models import left_padded_batch, tiny_adapters, tiny_model

LOGIT_TOLERANCE = dict(atol=1e-4, rtol=1e-4)
STEPS = 4
# local_tokens = 0: the newest key is attended only if its signature selects it, so a signature
# written after the selection (or never) changes the logits.
CONFIG = dict(sink_tokens=2, local_tokens=0, budget_tokens=10, sparse_prompt_tokens=5)


def encode_in_update(monkeypatch):
    """The behaviour before deferral: ``update`` encodes its keys at once (the single-stack encoder)."""
    deferred_update = SignatureStaticLayer.update

    def update(self, key_states, value_states, *args, **kwargs):
        out = deferred_update(self, key_states, value_states, *args, **kwargs)
        self.flush_pending_keys()
        return out

    monkeypatch.setattr(SignatureStaticLayer, "update", update)


def assert_signatures_complete(cache, adapters):
    """Every written slot's signatures equal encoding the cached key directly."""
    for index, layer in enumerate(cache.layers):
        if not isinstance(layer, SignatureStaticLayer):
            continue
        assert layer._pending_keys is None, f"layer {index}: keys left pending after the forward"
        length = int(layer.cumulative_length)
        stored = layer._key_signatures[:, :, :length]
        want = adapters[index].key_signatures(layer.keys[:, :, :length])
        assert torch.equal(stored, want), f"layer {index}: cached key signatures differ from encoding the keys"


def greedy_steps(model, ids, mask, cache, adapters, forward=None):
    """Prefill, then STEPS greedy single-token steps; returns the per-step last logits and checks the
    signature cache after each step."""
    forward = forward or model.forward
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        assert_signatures_complete(cache, adapters)
        for _ in range(STEPS):
            token = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            out = forward(input_ids=token, attention_mask=mask, past_key_values=cache)
            logits.append(out.logits[:, -1])
            assert_signatures_complete(cache, adapters)
    return logits


@pytest.mark.parametrize("key_heads", ["query", "kv"])
@pytest.mark.parametrize("dense_layers", [(), (0,)])
def test_deferred_encoding_gives_the_same_logits(monkeypatch, key_heads, dense_layers):
    """Eager and compiled (inductor, fullgraph, static cache) decode steps with deferred key encoding
    give the logits of encoding keys in update, and leave the same complete signature cache."""
    model = tiny_model("llama", layers=3)
    adapters = tiny_adapters(model, key_heads=key_heads)
    _, ids, mask = left_padded_batch([19, 12], seed=60)
    config = HashAttentionConfig(dense_layers=list(dense_layers), **CONFIG)
    slots = ids.shape[1] + STEPS + 1

    def run(forward=None):
        return greedy_steps(model, ids, mask, StaticCache(config=model.config, max_cache_len=slots), adapters, forward)

    with patch(model, adapters, config):
        deferred = run()
        torch._dynamo.reset()
        compiled = run(torch.compile(model.forward, fullgraph=True))
        with monkeypatch.context() as m:
            encode_in_update(m)
            immediate = run()
    dense = run()
    for step, (got, want) in enumerate(zip(deferred, immediate)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"eager step {step}: {m}")
    for step, (got, want) in enumerate(zip(compiled, immediate)):
        torch.testing.assert_close(got, want, **LOGIT_TOLERANCE, msg=lambda m: f"compiled step {step}: {m}")
    assert max((s - d).abs().max() for s, d in zip(deferred, dense)) > 1e-3, "the budget must matter"


class EncoderCalls(TorchDispatchMode):
    """Counts the encoder ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.counts = {"encode_signatures": 0, "encode_signatures_pair": 0, "encode_signatures_pair_into": 0,
                       "encode_pair_and_select": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "hashattention" and name in self.counts:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dense_layers", [(), (1,)])
def test_decode_step_makes_one_encoder_call_per_sparse_layer(dense_layers):
    """A static-cache decode step encodes each sparse layer's query and new key in ONE
    encode_pair_and_select call that also stores the key's signatures and selects (no separate key
    encode, no copy of the cache), eager and in the compiled graph."""
    from torch._inductor.utils import run_and_get_code

    model = tiny_model("llama", layers=3)
    adapters = tiny_adapters(model)
    _, ids, mask = left_padded_batch([19, 12], seed=61)
    sparse_layers = 3 - len(dense_layers)
    config = HashAttentionConfig(dense_layers=list(dense_layers), **CONFIG)
    with patch(model, adapters, config), torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 3)
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        token = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        with EncoderCalls() as calls:
            out = model(input_ids=token, attention_mask=mask, past_key_values=cache)
        assert calls.counts == {"encode_signatures": 0, "encode_signatures_pair": 0,
                                "encode_signatures_pair_into": 0, "encode_pair_and_select": sparse_layers}

        token = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        torch._dynamo.reset()
        step = torch.compile(model.forward, fullgraph=True)
        _, code = run_and_get_code(step, input_ids=token, attention_mask=mask, past_key_values=cache)
    source = "\n".join(code)
    assert source.count("hashattention.encode_pair_and_select.default(") == sparse_layers
    assert "hashattention.encode_signatures.default(" not in source
    # The cache is written in place by the op (re-inplaced by inductor): no functionalized copy of it.
    assert "auto_functionalized" not in source
    assert_signatures_complete(cache, adapters)


def test_dynamic_cache_still_encodes_in_update():
    """SignatureDynamicLayer keeps encoding keys in update: two single encodes per layer and step."""
    model = tiny_model("llama", layers=2)
    adapters = tiny_adapters(model)
    ids = left_padded_batch([15], seed=62)[1]
    with patch(model, adapters, HashAttentionConfig(**CONFIG)), torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=cache)
        with EncoderCalls() as calls:
            model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache)
        for index, layer in enumerate(cache.layers):
            assert torch.equal(layer.key_signatures, adapters[index].key_signatures(layer.keys))
    assert calls.counts == {"encode_signatures": 4, "encode_signatures_pair": 0, "encode_signatures_pair_into": 0, "encode_pair_and_select": 0}


# ---------------------------------------------------------------- the layer on its own


def filled_layer(batch=2, keys=5, seed=0):
    """A SignatureStaticLayer after one update of ``keys`` keys (pending, not yet encoded)."""
    model = tiny_model("llama", layers=1)
    adapter = tiny_adapters(model, seed=seed)[0]
    g = torch.Generator().manual_seed(seed)
    layer = SignatureStaticLayer(max_cache_len=9, adapter=adapter)
    key_states = torch.randn(batch, 2, keys, 64, generator=g)
    layer.update(key_states, torch.randn(batch, 2, keys, 64, generator=g))
    return layer, adapter, key_states


def test_reading_key_signatures_encodes_pending_keys():
    layer, adapter, key_states = filled_layer()
    assert layer._pending_keys is not None and not layer._key_signatures.any(), "update defers the encode"
    signatures = layer.key_signatures
    assert layer._pending_keys is None
    assert torch.equal(signatures[:, :, :5], adapter.key_signatures(key_states))
    assert not signatures[:, :, 5:].any()


def test_query_and_key_signatures_writes_pending_keys_in_one_call():
    layer, adapter, key_states = filled_layer()
    query = torch.randn(2, 4, 1, 64, generator=torch.Generator().manual_seed(5))
    with EncoderCalls() as calls:
        query_signatures, signatures = layer.query_and_key_signatures(query)
    assert calls.counts == {"encode_signatures": 0, "encode_signatures_pair": 0, "encode_signatures_pair_into": 1, "encode_pair_and_select": 0}
    assert signatures is layer._key_signatures and layer._pending_keys is None
    assert torch.equal(query_signatures, adapter.query_signatures(query))
    assert torch.equal(signatures[:, :, :5], adapter.key_signatures(key_states))
    with EncoderCalls() as calls:  # nothing pending any more: the query alone
        again, _ = layer.query_and_key_signatures(query)
    assert calls.counts == {"encode_signatures": 1, "encode_signatures_pair": 0, "encode_signatures_pair_into": 0, "encode_pair_and_select": 0}
    assert torch.equal(again, query_signatures)


def test_select_with_pending_keys_writes_them_and_selects_in_one_call():
    layer, adapter, key_states = filled_layer()
    query = torch.randn(2, 4, 1, 64, generator=torch.Generator().manual_seed(5))
    selection = dict(selection_heads=4, sink_tokens=1, local_tokens=1, budget_tokens=2)
    with EncoderCalls() as calls:
        indices, counts = layer.select_with_pending_keys(query, **selection)
    assert calls.counts == {"encode_signatures": 0, "encode_signatures_pair": 0, "encode_signatures_pair_into": 0,
                            "encode_pair_and_select": 1}
    assert layer._pending_keys is None
    assert torch.equal(layer._key_signatures[:, :, :5], adapter.key_signatures(key_states))
    want = ha.ops.hamming_topk(adapter.query_signatures(query), layer._key_signatures, **selection)
    assert torch.equal(indices, want[0]) and torch.equal(counts, want[1])
    assert layer.select_with_pending_keys(query, **selection) is None  # nothing pending any more


def test_a_second_update_encodes_the_first_chunk():
    layer, adapter, first = filled_layer(keys=3)
    second = torch.randn(2, 2, 2, 64, generator=torch.Generator().manual_seed(7))
    layer.update(second, torch.zeros_like(second))
    assert torch.equal(layer._key_signatures[:, :, :3], adapter.key_signatures(first)), "first chunk flushed"
    assert torch.equal(layer.key_signatures[:, :, 3:5], adapter.key_signatures(second))


def test_reset_drops_pending_keys():
    layer, _, _ = filled_layer()
    layer.reset()
    assert layer._pending_keys is None and not layer.key_signatures.any()


def test_reorder_cache_encodes_pending_keys_in_the_old_order():
    layer, adapter, key_states = filled_layer()
    beam_idx = torch.tensor([1, 0])
    layer.reorder_cache(beam_idx)
    assert torch.equal(layer.key_signatures[:, :, :5], adapter.key_signatures(key_states[beam_idx]))


def test_setting_the_buffer_replaces_pending_keys():
    layer, _, _ = filled_layer()
    buffer = torch.full_like(layer._key_signatures, 7)
    layer.key_signatures = buffer
    assert layer._pending_keys is None and layer.key_signatures is buffer and bool((buffer == 7).all())
