"""Valid lengths, left-padding offsets and budgets are computed once per forward pass and shared by every sparse layer."""

import pytest
import torch
from transformers import DynamicCache, StaticCache

import hashattention.attention as attention_module
from hashattention.cache import SIGNATURE_LAYERS, SharedSelectionBounds
from hashattention.config import HashAttentionConfig
from hashattention.patching import patch

from hf_models import left_padded_batch, tiny_adapters, tiny_model

LOGIT_TOLERANCE = dict(atol=1e-4, rtol=1e-4)
CONFIG = dict(sink_tokens=2, local_tokens=4, budget_tokens=12, sparse_prompt_tokens=5)


def left_padded(lengths, seed):
    _, ids, mask = left_padded_batch(lengths, seed)
    return ids, mask


def decode(model, ids, mask, cache, steps, forward=None):
    """Prefill, then ``steps`` greedy single-token steps; returns the per-step last logits."""
    forward = forward or model.forward
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            out = forward(input_ids=token, attention_mask=mask, past_key_values=cache)
            logits.append(out.logits[:, -1])
    return logits


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("dense_layers", [(), (0,)])
def test_offsets_are_computed_once_per_forward(monkeypatch, cache_kind, dense_layers):
    """One reduction of the mask per forward pass (not one per layer), with the same logits as
    when every layer computes its own offsets and budgets."""
    model = tiny_model("llama", layers=3)
    adapters = tiny_adapters(model)
    ids, mask = left_padded([21, 13, 17], seed=40)
    config = HashAttentionConfig(dense_layers=list(dense_layers), **CONFIG)

    def make_cache():
        return DynamicCache(config=model.config) if cache_kind == "dynamic" else StaticCache(
            config=model.config, max_cache_len=ids.shape[1] + 4)

    with patch(model, adapters, config):
        shared = decode(model, ids, mask, make_cache(), steps=3)
    calls, length_reads = [], []
    original = attention_module.compute_selection_bounds

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(attention_module, "compute_selection_bounds", counting)
    for layer_type in SIGNATURE_LAYERS:
        def counting_lengths(self, *args, _original=layer_type.valid_lengths, **kwargs):
            length_reads.append(1)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(layer_type, "valid_lengths", counting_lengths)
    with patch(model, adapters, config):
        decode(model, ids, mask, make_cache(), steps=3)
    assert len(calls) == 4, f"{len(calls)} reductions for 4 forward passes"
    assert len(length_reads) == 4, f"{len(length_reads)} reads of the valid lengths for 4 forward passes"
    # Every layer computing its own offsets and budgets (no start layer) gives the same logits.
    selection_bounds = attention_module.selection_bounds
    monkeypatch.setattr(attention_module, "selection_bounds",
                        lambda config, mask, lengths, batch, device, *layers, **kwargs: selection_bounds(
                            config, mask, lengths, batch, device))
    with patch(model, adapters, config):
        per_layer = decode(model, ids, mask, make_cache(), steps=3)
    for step, (got, want) in enumerate(zip(shared, per_layer)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"step {step}: {m}")


def test_compiled_step_reads_the_shared_offsets():
    """Under inductor the later layers read the offsets the first sparse layer stored in the
    static cache in the same graph: compiled logits equal eager ones, left padding included."""
    model = tiny_model("llama", layers=3)
    adapters = tiny_adapters(model)
    ids, mask = left_padded([19, 11], seed=44)
    config = HashAttentionConfig(dense_layers=[0], **CONFIG)
    with patch(model, adapters, config):
        eager = decode(model, ids, mask, StaticCache(config=model.config, max_cache_len=24), steps=3)
        torch._dynamo.reset()
        compiled = decode(model, ids, mask, StaticCache(config=model.config, max_cache_len=24), steps=3,
                          forward=torch.compile(model.forward, fullgraph=True))
    for step, (got, want) in enumerate(zip(compiled, eager)):
        torch.testing.assert_close(got, want, **LOGIT_TOLERANCE, msg=lambda m: f"step {step}: {m}")


def test_compiled_step_computes_the_bounds_once_through_the_op():
    """The compiled decode step calls selection_bounds once per forward, every layer's selection reads
    its three output buffers (inductor recomputed inline bounds once per reading layer), and the mask
    has no reduction of its own (an inline one fused with the budget arithmetic was a kernel Triton 3.6
    could not compile). No traced bounds outlive the forward."""
    import re

    from torch._inductor.utils import run_and_get_code

    layers = 3
    model = tiny_model("llama", layers=layers)
    ids, mask = left_padded([19, 11], seed=45)
    with patch(model, tiny_adapters(model), HashAttentionConfig(**CONFIG)), torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=24)
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        token = out.logits[:, -1:].argmax(-1)
        torch._dynamo.reset()
        step = torch.compile(model.forward, fullgraph=True)
        _, code = run_and_get_code(step, input_ids=token, attention_mask=torch.cat([mask, torch.ones_like(token)], 1),
                                   past_key_values=cache)
    source = "\n".join(code)
    assert source.count("hashattention.selection_bounds.default(") == 1
    assert "amin" not in source and "argmax" not in source
    selections = re.findall(r"hashattention\.encode_pair_and_select\.default\(([^)]*)\)", source)
    assert len(selections) == layers
    # encode_pair_and_select(..., budget_tokens, lengths, start_positions, budgets): the last three
    bounds = {tuple(a.strip() for a in args.split(",")[-3:]) for args in selections}
    assert len(bounds) == 1, f"layers read different bounds buffers: {bounds}"
    assert all(layer.selection_bounds.traced is None for layer in cache.layers)


def test_shared_bounds_are_not_read_for_another_mask_or_batch():
    """Outside torch.compile a layer called with another mask (or batch size) than the one the
    offsets came from gets None and recomputes: no stale offsets or budgets."""
    shared = SharedSelectionBounds()
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    assert shared.load(mask, 2) is None
    shared.allocate(2, "cpu")
    lengths = torch.tensor([9, 8], dtype=torch.int32)
    starts, budgets = torch.tensor([3, 0], dtype=torch.int32), torch.tensor([5, 7], dtype=torch.int32)
    storage = (shared.lengths, shared.start_positions, shared.budgets)
    shared.store(lengths, starts, budgets, mask)
    assert all(a is b for a, b in zip((shared.lengths, shared.start_positions, shared.budgets), storage)), \
        "buffers are written in place"
    loaded = shared.load(mask, 2)
    assert all(torch.equal(a, b) for a, b in zip(loaded, (lengths, starts, budgets)))
    assert shared.load(mask.clone(), 2) is None
    assert shared.load(mask, 3) is None


@pytest.mark.parametrize("keys", [0, 1, 37, 4136])
def test_first_visible_key_matches_argmax(keys):
    """The op equals argmax of the row (the first True), 0 for a row with none, on random masks."""
    g = torch.Generator().manual_seed(keys)
    starts = torch.randint(0, max(keys, 1), (6,), generator=g)
    visible = (torch.arange(keys) >= starts[:, None]) & (torch.rand(6, keys, generator=g) > 0.2)
    visible[0] = False
    expected = visible.to(torch.int32).argmax(dim=-1).to(torch.int32) if keys else torch.zeros(6, dtype=torch.int32)
    got = torch.ops.hashattention.first_visible_key(visible)
    assert got.dtype == torch.int32 and torch.equal(got, expected)


def test_first_visible_key_rejects_bad_input():
    with pytest.raises(ValueError, match="visible must be a 2-D bool tensor"):
        torch.ops.hashattention.first_visible_key(torch.ones(2, 5))
    with pytest.raises(ValueError, match="visible must be a 2-D bool tensor"):
        torch.ops.hashattention.first_visible_key(torch.ones(2, 1, 5, dtype=torch.bool))


def test_compiled_layers_share_the_bounds_without_a_mask():
    """Without a mask (no padding) eager layers each compute their bounds, but a compiled forward still
    computes them once: one op call whose outputs every layer reads, equal to the eager values."""
    import types

    from torch._inductor.utils import run_and_get_code

    config = HashAttentionConfig(sink_tokens=2, local_tokens=4, sparsity=4.0)
    layers = [types.SimpleNamespace(selection_bounds=SharedSelectionBounds()) for _ in range(3)]

    def three_layers(lengths):
        return [torch.stack(attention_module.selection_bounds(
            config, None, lambda: lengths + 0, 2, lengths.device, layer, layers[0], last_layer=index == 2))
            for index, layer in enumerate(layers)]

    lengths = torch.tensor([37, 120], dtype=torch.int32)
    eager = three_layers(lengths)
    torch._dynamo.reset()
    compiled, code = run_and_get_code(torch.compile(three_layers, fullgraph=True), lengths)
    assert "\n".join(code).count("hashattention.selection_bounds.default(") == 1
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
    assert eager[0].tolist() == [[37, 120], [0, 0], [9 - 6, 30 - 6]]
    assert layers[0].selection_bounds.traced is None
