"""The Hugging Face integration on tiny random-weight Llama / Mistral models (CPU, float32)."""

import re

import pytest
import torch
from transformers import DynamicCache, StaticCache

from hashattention.cache import SignatureDynamicLayer, SignatureStaticLayer
from hashattention.config import HashAttentionConfig
from hashattention.patching import is_patched, patch, unpatch

from hf_models import REFERENCE_NAME, configure_reference, left_padded_batch, random_ids, tiny_adapters, tiny_model

PROMPT, STEPS = 40, 6
LOGIT_TOLERANCE = dict(atol=1e-4, rtol=1e-4)


def make_cache(kind: str, model, max_len: int):
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    return StaticCache(config=model.config, max_cache_len=max_len)


def stepwise_logits(model, ids, cache, steps=STEPS, attention_mask=None, tokens=None):
    """Prefill ``ids`` then ``steps`` single-token decode steps; next tokens are ``tokens`` (teacher
    forcing) or greedy. Returns the list of logits ``[(B, L, V) prefill, (B, 1, V) per step]`` and the tokens."""
    outputs, chosen = [], []
    mask = attention_mask
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        outputs.append(out.logits)
        for step in range(steps):
            nxt = out.logits[:, -1:].argmax(-1) if tokens is None else tokens[step]
            chosen.append(nxt)
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            out = model(input_ids=nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
            outputs.append(out.logits)
    return outputs, chosen


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("selection", ["query_head", "kv_group"])
def test_full_budget_equals_sdpa(kind, cache_kind, selection):
    model = tiny_model(kind)
    adapters = tiny_adapters(model)
    ids = random_ids(1, PROMPT, seed=3)
    reference, tokens = stepwise_logits(model, ids, make_cache(cache_kind, model, PROMPT + STEPS))
    config = HashAttentionConfig(
        sink_tokens=4, local_tokens=4, budget_tokens=PROMPT + STEPS, sparse_prompt_tokens=8, selection=selection
    )
    with patch(model, adapters, config):
        cache = make_cache(cache_kind, model, PROMPT + STEPS)
        patched, _ = stepwise_logits(model, ids, cache, tokens=tokens)
        expected_layer = SignatureDynamicLayer if cache_kind == "dynamic" else SignatureStaticLayer
        assert all(isinstance(layer, expected_layer) for layer in cache.layers)
    for step, (got, want) in enumerate(zip(patched, reference)):
        torch.testing.assert_close(got, want, **LOGIT_TOLERANCE, msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("convert_filled", [False, True])
def test_static_signature_rows_are_16_byte_aligned(convert_filled):
    """Static caches of any length keep each head's signature row 16-byte aligned (the CUDA
    selection's one-launch path needs four one-word signatures per 16-byte load) in a contiguous
    buffer, whether the layer is created empty or converted from a filled StaticLayer."""
    model = tiny_model("llama")
    adapters = tiny_adapters(model)
    slots = PROMPT + STEPS + 1  # 47: not a multiple of 4
    ids = random_ids(1, PROMPT, seed=5)
    cache = make_cache("static", model, slots)
    if convert_filled:
        model(ids, past_key_values=cache, use_cache=True)
    with patch(model, adapters, HashAttentionConfig(sink_tokens=4, local_tokens=4, budget_tokens=8)):
        stepwise_logits(model, ids if not convert_filled else ids[:, -1:], cache, steps=2)
        for layer in cache.layers:
            signatures = layer.key_signatures
            assert isinstance(layer, SignatureStaticLayer) and signatures.shape[2] == 48
            assert signatures.is_contiguous() and signatures.data_ptr() % 16 == 0
            assert not signatures[:, :, slots:].any(), "padding slots must stay zero"


def test_compiled_decode_step_does_not_copy_the_signature_cache():
    """Under torch.compile (inductor) a decode step writes the new key's signatures in place and
    hands the cache buffer itself to hamming_topk. A strided (view) buffer made inductor allocate a
    contiguous copy of the whole signature cache before each call (H200: ~1 ms per step at 128K,
    B = 4), so no buffer of the signature cache's size may appear in the generated code. (A static
    cache's decode step selects with encode_pair_and_select, which also writes the new key.)"""
    from torch._inductor.utils import run_and_get_code

    model = tiny_model("llama", layers=1)
    adapters = tiny_adapters(model)
    slots = PROMPT + STEPS + 1
    ids = random_ids(1, PROMPT, seed=6)
    cache = make_cache("static", model, slots)
    with patch(model, adapters, HashAttentionConfig(sink_tokens=4, local_tokens=4, budget_tokens=8)), torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        step = torch.compile(model.forward, fullgraph=True)
        _, code = run_and_get_code(
            step, ids[:, -1:], past_key_values=cache, use_cache=True, cache_position=torch.tensor([PROMPT])
        )
        signature_shape = tuple(cache.layers[0].key_signatures.shape)
    source = "\n".join(code)
    assert "hashattention.encode_pair_and_select" in source
    allocated = {tuple(int(v) for v in m.split(",") if v.strip()) for m in re.findall(r"empty_strided_\w+\(\(([\d, ]+)\)", source)}
    copies = [shape for shape in allocated if len(shape) == 4 and shape[2] >= slots]
    assert not copies, f"a signature-cache-sized buffer {copies} is allocated per step (cache {signature_shape})"


@pytest.mark.parametrize("convert_filled", [False, True])
def test_static_layers_keep_a_zeroed_attention_workspace(monkeypatch, convert_filled):
    """Every static signature layer, created empty or converted from a filled StaticLayer, holds
    zeroed int32 split counters covering B x Hq x 128 query rows, hands them out for calls they
    cover (None beyond), and they stay zero across decode steps. (Forced here: they exist on CUDA.)"""
    import hashattention.cache as cache_module

    monkeypatch.setattr(cache_module, "needs_attention_workspace", lambda device: True)
    model = tiny_model("llama")
    adapters = tiny_adapters(model)
    heads, batch = model.config.num_attention_heads, 2
    ids = random_ids(batch, PROMPT, seed=8)
    cache = make_cache("static", model, PROMPT + STEPS + 1)
    if convert_filled:
        model(ids, past_key_values=cache, use_cache=True)
    with patch(model, adapters, HashAttentionConfig(sink_tokens=4, local_tokens=4, budget_tokens=8)):
        stepwise_logits(model, ids if not convert_filled else ids[:, -1:], cache, steps=2)
    for layer in cache.layers:
        workspace = layer.attention_workspace(batch, heads, 1)
        assert workspace is not None and workspace.dtype == torch.int32
        assert workspace.numel() == batch * heads * cache_module.ATTENTION_WORKSPACE_ROWS and not workspace.any()
        assert layer.attention_workspace(batch, heads, cache_module.ATTENTION_WORKSPACE_ROWS + 1) is None


def test_compiled_decode_step_hands_the_attention_workspace_over_in_place(monkeypatch):
    """A static cache layer keeps zeroed split counters for the CUDA attention (no memset per call);
    under torch.compile the op must get that buffer itself -- a functionalised copy per step would
    cost more than the memset it saves -- and it must stay zero. The buffer exists on CUDA only, so
    it is forced here (the CPU kernel checks it and leaves it alone)."""
    import hashattention.cache as cache_module
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(cache_module, "needs_attention_workspace", lambda device: True)
    model = tiny_model("llama", layers=1)
    adapters = tiny_adapters(model)
    ids = random_ids(1, PROMPT, seed=7)
    cache = make_cache("static", model, PROMPT + STEPS + 1)
    with patch(model, adapters, HashAttentionConfig(sink_tokens=4, local_tokens=4, budget_tokens=8)), torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        workspace = cache.layers[0].attention_workspace(1, model.config.num_attention_heads, 1)
        assert workspace is not None and workspace.dtype == torch.int32
        step = torch.compile(model.forward, fullgraph=True)
        _, code = run_and_get_code(
            step, ids[:, -1:], past_key_values=cache, use_cache=True, cache_position=torch.tensor([PROMPT])
        )
    source = "\n".join(code)
    assert "hashattention.sparse_attention" in source
    sizes = {int(m) for m in re.findall(r"empty_strided_\w+\(\((\d+), *\)", source)}
    assert workspace.numel() not in sizes, "the attention workspace is copied before the op"
    assert not workspace.any()


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("selection", ["query_head", "kv_group"])
@pytest.mark.parametrize("key_heads", ["query", "kv"])
def test_small_budget_equals_masked_reference(kind, selection, key_heads):
    """Patched model with a cache == the oracle recomputing the same selection from scratch, step by step."""
    model = tiny_model(kind)
    adapters = tiny_adapters(model, key_heads=key_heads)
    config = HashAttentionConfig(
        sink_tokens=3, local_tokens=4, budget_tokens=15, sparse_prompt_tokens=6, selection=selection
    )
    ids = random_ids(1, PROMPT, seed=4)
    with patch(model, adapters, config):
        patched, tokens = stepwise_logits(model, ids, DynamicCache(config=model.config))

    configure_reference(adapters, config, sparse_from=PROMPT - config.sparse_prompt_tokens)
    model.set_attn_implementation(REFERENCE_NAME)
    sequence = torch.cat([ids, *tokens], dim=1)
    with torch.no_grad():
        for step, got in enumerate(patched):
            length = PROMPT + step
            want = model(input_ids=sequence[:, :length], use_cache=False).logits
            want = want if step == 0 else want[:, -1:]
            torch.testing.assert_close(got, want, **LOGIT_TOLERANCE, msg=lambda m: f"step {step}: {m}")
        model.set_attn_implementation("sdpa")
        dense = model(input_ids=sequence, use_cache=False).logits
    # The budget really is small: sparse logits differ from dense ones (so this test can fail).
    assert (patched[-1][:, -1] - dense[:, -1]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_generate_batch_with_left_padding_equals_unbatched(kind, cache_implementation):
    model = tiny_model(kind)
    adapters = tiny_adapters(model)
    config = HashAttentionConfig(sink_tokens=2, local_tokens=4, budget_tokens=14, sparse_prompt_tokens=5)
    rows, ids, mask = left_padded_batch([37, 23, 30], seed=10)
    generate = dict(
        max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True,
        cache_implementation=cache_implementation,
    )
    with patch(model, adapters, config), torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, **generate)
        # Padding is never selected: other pad ids (other pad keys) change nothing.
        repadded = model.generate(ids.masked_fill(mask == 0, 7), attention_mask=mask, **generate)
        singles = [model.generate(row[None], attention_mask=torch.ones_like(row[None]), **generate) for row in rows]
    new_tokens = batched.sequences[:, ids.shape[1] :]
    assert torch.equal(new_tokens, repadded.sequences[:, ids.shape[1] :])
    for i, single in enumerate(singles):
        assert torch.equal(new_tokens[i], single.sequences[0, len(rows[i]) :]), f"sequence {i}"
        for step, (scores, single_scores) in enumerate(zip(batched.scores, single.scores)):
            torch.testing.assert_close(scores[i], single_scores[0], **LOGIT_TOLERANCE, msg=f"sequence {i} step {step}")


def test_sampling_with_top_k_1_equals_greedy_and_sampling_runs():
    model = tiny_model("llama")
    config = HashAttentionConfig(sink_tokens=2, local_tokens=4, budget_tokens=14, sparse_prompt_tokens=5)
    ids = random_ids(2, 30, seed=5)
    with patch(model, tiny_adapters(model), config), torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=6, do_sample=False)
        top1 = model.generate(ids, max_new_tokens=6, do_sample=True, top_k=1)
        torch.manual_seed(0)
        sampled = model.generate(ids, max_new_tokens=6, do_sample=True, temperature=1.5)
        torch.manual_seed(0)
        sampled_again = model.generate(ids, max_new_tokens=6, do_sample=True, temperature=1.5)
    assert torch.equal(greedy, top1)
    assert sampled.shape == greedy.shape and torch.equal(sampled, sampled_again)


def test_patch_and_unpatch_restore_outputs():
    model = tiny_model("llama")
    ids = random_ids(1, 32, seed=6)
    with torch.no_grad():
        before = model(ids).logits
        config = HashAttentionConfig(sink_tokens=2, local_tokens=2, budget_tokens=8, sparse_prompt_tokens=16)
        handle = patch(model, tiny_adapters(model), config)
        assert is_patched(model) and model.config._attn_implementation == "hashattention"
        patched = model(ids).logits
        unpatch(model)
        after = model(ids).logits
        with patch(model, tiny_adapters(model), config):
            inside = model(ids).logits
        outside = model(ids).logits
    assert not is_patched(model) and model.config._attn_implementation == "sdpa"
    assert torch.equal(before, after) and torch.equal(before, outside)
    assert (patched - before).abs().max() > 1e-3 and torch.equal(patched, inside)
    assert handle.model is model
    with pytest.raises(ValueError, match="not patched"):
        unpatch(model)


def test_dense_layers_and_decode_only_prompt():
    """dense_layers run SDPA (no signatures); sparse_prompt_tokens=0 keeps the whole prompt dense."""
    model = tiny_model("llama")
    ids = random_ids(1, 30, seed=8)
    with torch.no_grad():
        dense = model(ids).logits
        config = HashAttentionConfig(sink_tokens=2, local_tokens=2, budget_tokens=6, sparse_prompt_tokens=0)
        with patch(model, tiny_adapters(model), config):
            prompt_dense = model(ids).logits
        config = HashAttentionConfig(
            sink_tokens=2, local_tokens=2, budget_tokens=6, sparse_prompt_tokens=30, dense_layers=[0, 1]
        )
        with patch(model, tiny_adapters(model), config):
            cache = DynamicCache(config=model.config)
            all_dense_layers = model(ids, past_key_values=cache).logits
            assert not any(isinstance(layer, SignatureDynamicLayer) for layer in cache.layers)
    torch.testing.assert_close(prompt_dense, dense, **LOGIT_TOLERANCE)
    torch.testing.assert_close(all_dense_layers, dense, **LOGIT_TOLERANCE)


def test_dense_below_and_sparsity_budget_select_everything_when_short():
    model = tiny_model("llama")
    ids = random_ids(1, 30, seed=9)
    with torch.no_grad():
        dense = model(ids).logits
        for config in (
            HashAttentionConfig(sink_tokens=2, local_tokens=2, budget_tokens=6, sparse_prompt_tokens=30,
                                dense_below_tokens=31),
            HashAttentionConfig(sink_tokens=2, local_tokens=2, sparsity=2.0, sparse_prompt_tokens=30,
                                dense_below_tokens=31),
        ):
            with patch(model, tiny_adapters(model), config):
                torch.testing.assert_close(model(ids).logits, dense, **LOGIT_TOLERANCE)
        with patch(model, tiny_adapters(model), HashAttentionConfig(sink_tokens=2, local_tokens=2, sparsity=2.0,
                                                                    sparse_prompt_tokens=30)):
            assert (model(ids).logits - dense).abs().max() > 1e-3


def test_static_decode_step_compiles_without_graph_breaks():
    """The CPU half of the GPU check: a StaticCache decode step traces as one graph and matches eager."""
    model = tiny_model("llama")
    config = HashAttentionConfig(sink_tokens=2, local_tokens=4, budget_tokens=14, sparse_prompt_tokens=5)
    _, ids, mask = left_padded_batch([20, 14], seed=12)
    with patch(model, tiny_adapters(model), config), torch.no_grad():
        results = []
        for compiled in (False, True):
            cache = StaticCache(config=model.config, max_cache_len=32)
            out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
            token = out.logits[:, -1:].argmax(-1)
            step_mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            forward = model.forward
            if compiled:
                torch._dynamo.reset()
                forward = torch.compile(model.forward, fullgraph=True, backend="eager")
            results.append(forward(input_ids=token, attention_mask=step_mask, past_key_values=cache).logits)
            if compiled:
                explanation = torch._dynamo.explain(model.forward)(
                    input_ids=token, attention_mask=torch.cat([step_mask, torch.ones_like(token)], 1),
                    past_key_values=cache,
                )
                assert explanation.graph_break_count == 0, explanation.break_reasons
    torch.testing.assert_close(results[1], results[0], **LOGIT_TOLERANCE)


def test_beam_search_reorders_signatures_with_the_cache():
    """Beam search at a small budget == the cache-free oracle generating with the same selection."""
    model = tiny_model("llama")
    adapters = tiny_adapters(model)
    config = HashAttentionConfig(sink_tokens=2, local_tokens=3, budget_tokens=12, sparse_prompt_tokens=4)
    ids = random_ids(1, 32, seed=13)
    beam = dict(max_new_tokens=6, num_beams=3, do_sample=False)
    with patch(model, adapters, config), torch.no_grad():
        patched = model.generate(ids, **beam)
    configure_reference(adapters, config, sparse_from=ids.shape[1] - config.sparse_prompt_tokens)
    model.set_attn_implementation(REFERENCE_NAME)
    with torch.no_grad():
        oracle = model.generate(ids, use_cache=False, **beam)
        model.set_attn_implementation("sdpa")
        dense = model.generate(ids, **beam)
    assert torch.equal(patched, oracle)
    assert not torch.equal(patched, dense)  # the budget changes the outcome, so reordering matters


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_cache_filled_before_patch_is_continued(cache_kind):
    """Plain cache layers filled unpatched are converted (their keys encoded once) and decode on sparse."""
    model = tiny_model("llama")
    adapters = tiny_adapters(model)
    ids = random_ids(1, PROMPT, seed=14)
    # Reference: patched from the start, with a dense prompt like the unpatched prefill below.
    config = HashAttentionConfig(sink_tokens=3, local_tokens=4, budget_tokens=15, sparse_prompt_tokens=0)
    with torch.no_grad():
        with patch(model, adapters, config):
            want, tokens = stepwise_logits(model, ids, make_cache(cache_kind, model, PROMPT + STEPS), steps=3)
        cache = make_cache(cache_kind, model, PROMPT + STEPS)
        model(input_ids=ids, past_key_values=cache, use_cache=True)  # unpatched prefill
        with patch(model, adapters, config):
            got = []
            for token in tokens:
                got.append(model(input_ids=token, past_key_values=cache, use_cache=True).logits)
            other = tiny_adapters(model, seed=99)
        with patch(model, other, config), pytest.raises(ValueError, match="other HashAttention adapters"):
            model(input_ids=tokens[0], past_key_values=cache, use_cache=True)
    for step, (g, w) in enumerate(zip(got, want[1:])):
        torch.testing.assert_close(g, w, **LOGIT_TOLERANCE, msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("mask_batch", [1, 5])
def test_start_positions_are_the_first_visible_key(mask_batch):
    """start_positions_from_mask (a min reduction, for torch.compile) equals argmax of the last mask row."""
    from hashattention.attention import start_positions_from_mask

    g = torch.Generator().manual_seed(mask_batch)
    keys, rows = 37, 3
    starts = torch.randint(0, keys, (mask_batch,), generator=g)
    ends = torch.maximum(starts + 1, torch.randint(0, keys + 1, (mask_batch,), generator=g))
    positions = torch.arange(keys)
    visible = (positions >= starts[:, None]) & (positions < ends[:, None])  # left padding, then future slots
    mask = visible[:, None, None, :].expand(mask_batch, 1, rows, keys).clone()
    if mask_batch > 1:
        mask[1, 0, -1] = False  # a last row with nothing visible: 0, as argmax gives
    expected = mask[:, 0, -1, :].to(torch.int32).argmax(dim=-1).to(torch.int32).expand(5)
    got = start_positions_from_mask(mask, 5, "cpu")
    assert got.dtype == torch.int32 and torch.equal(got, expected)
    assert torch.equal(start_positions_from_mask(None, 5, "cpu"), torch.zeros(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="boolean attention mask"):
        start_positions_from_mask(mask.float(), 5, "cpu")
