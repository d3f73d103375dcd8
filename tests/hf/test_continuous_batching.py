"""HashAttention under transformers' continuous batching (``paged|hashattention``) on tiny models (CPU, float32)."""

import dataclasses

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.modeling_utils import AttentionInterface

from hashattention import paged_attention, signature_pages
from hashattention.config import HashAttentionConfig
from hashattention.paged_attention import PAGED_ATTENTION_NAME, paged_hashattention_forward
from hashattention.patching import patch

from hf_models import random_ids, tiny_adapters, tiny_model

# Prompt lengths (one longer than a batch's token budget: its prompt is split over two batches)
# and generation lengths: the requests start and finish at different steps.
PROMPTS = (5, 41, 3, 23, 30, 17)
NEW_TOKENS = (9, 4, 12, 6, 10, 7)
SPARSE = HashAttentionConfig(sink_tokens=2, local_tokens=3, sparsity=4, sparse_prompt_tokens=4)


def batching_config(**overrides):
    settings = dict(block_size=4, num_blocks=48, max_batch_tokens=32, max_requests_per_batch=3)
    settings.update(overrides)
    return ContinuousBatchingConfig(**settings)


def prompts(lengths=PROMPTS, seed=0):
    return [random_ids(1, n, seed + i)[0].tolist() for i, n in enumerate(lengths)]


def run_requests(model, requests, new_tokens, config=None, persistent=False, generation=None, sequences=1):
    """Generated tokens of each request, submitted together to one manager (greedy by default).

    Returns a list in request order, or with ``sequences > 1`` (``num_return_sequences``) a dict
    from each sequence's request id to its tokens.
    """
    generation = generation or GenerationConfig(do_sample=False, pad_token_id=0, eos_token_id=-1)
    results = {}
    with model.continuous_batching_context_manager(
        generation_config=generation, continuous_batching_config=config or batching_config(),
        persistent_manager=persistent,
    ) as manager:
        assert model.config._attn_implementation.startswith("paged|")
        for index, (ids, count) in enumerate(zip(requests, new_tokens)):
            manager.add_request(ids, request_id=f"r{index}", max_new_tokens=count)
        while len(results) < len(requests) * sequences:
            result = manager.get_result(timeout=30)
            assert result is not None, "the manager stopped answering"
            if result.is_finished():
                assert result.error is None, result.error
                results[result.request_id] = result.generated_tokens
    if sequences > 1:
        return results
    return [results[f"r{index}"] for index in range(len(requests))]


def generate_alone(model, ids, count):
    ids = torch.tensor([ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


class BatchSpy:
    """Records layer 0's packed batches: (rows per request, final-chunk flags)."""

    def __init__(self):
        self.batches = []

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx == 0:
            cu = kwargs["cu_seq_lens_q"]
            self.batches.append(((cu[1:] - cu[:-1]).tolist(), kwargs["logits_indices"].tolist()))
        return paged_hashattention_forward(module, query, key, value, attention_mask, **kwargs)

    def __enter__(self):
        AttentionInterface.register(PAGED_ATTENTION_NAME, self)
        return self

    def __exit__(self, *exc):
        paged_attention.register()

    def mixed(self) -> bool:
        """Some batch held a decode row and a prompt chunk together."""
        return any(1 in lengths and max(lengths) > 1 for lengths, _ in self.batches)

    def chunked(self) -> bool:
        """Some batch held a prompt chunk that does not end its prompt (no logits kept for its last row)."""
        for lengths, logits in self.batches:
            ends = [sum(lengths[: i + 1]) - 1 for i in range(len(lengths))]
            if any(end not in logits for end in ends):
                return True
        return False


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_full_budget_equals_paged_sdpa(kind):
    model = tiny_model(kind)
    requests = prompts()
    model.set_attn_implementation("paged|sdpa")
    reference = run_requests(model, requests, NEW_TOKENS)
    model.set_attn_implementation("sdpa")
    config = HashAttentionConfig(sink_tokens=2, local_tokens=2, budget_tokens=128, sparse_prompt_tokens=4)
    with patch(model, tiny_adapters(model), config), BatchSpy() as spy:
        got = run_requests(model, requests, NEW_TOKENS)
    assert spy.mixed() and spy.chunked()
    assert got == reference
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("kind, selection", [("llama", "query_head"), ("mistral", "kv_group")])
def test_sparse_equals_generate_alone(kind, selection):
    model = tiny_model(kind)
    requests = prompts()
    dense = [generate_alone(model, ids, count) for ids, count in zip(requests, NEW_TOKENS)]
    config = HashAttentionConfig(sink_tokens=2, local_tokens=3, sparsity=4, sparse_prompt_tokens=4,
                                 selection=selection)
    with patch(model, tiny_adapters(model), config):
        with BatchSpy() as spy:
            got = run_requests(model, requests, NEW_TOKENS)
        alone = [generate_alone(model, ids, count) for ids, count in zip(requests, NEW_TOKENS)]
    assert spy.mixed() and spy.chunked()
    assert got == alone
    assert alone != dense  # the selection matters for these requests


def test_reused_blocks_carry_no_stale_signatures():
    """Blocks freed by finished requests serve new ones: with every signature page overwritten by
    garbage in between, the new requests still generate what they generate alone."""
    model = tiny_model("llama")
    first, second = prompts((22, 30, 9), seed=10), prompts((26, 14, 31), seed=20)
    config = batching_config(num_blocks=24)  # the second session needs blocks the first one used
    with patch(model, tiny_adapters(model), SPARSE):
        run_requests(model, first, (8, 8, 8), config, persistent=True)
        manager = model._cached_continuous_batching_manager
        pages = signature_pages.signature_pages(manager.batch_processor.cache)
        assert sorted(pages.layers) == [0, 1]

        def poison():
            generator = torch.Generator().manual_seed(0)
            for layer in pages.layers.values():
                layer.copy_(torch.randint(-2**31, 2**31 - 1, layer.shape, generator=generator, dtype=torch.int32))

        poison()
        got = run_requests(model, second, (8, 8, 8), config, persistent=True)
        alone = [generate_alone(model, ids, 8) for ids in second]
        assert got == alone

        # Control: the same session with the new keys' signatures never written reads the garbage.
        poison()
        write = signature_pages.write
        signature_pages.write = lambda *args: None
        try:
            stale = run_requests(model, second, (8, 8, 8), config, persistent=True)
        finally:
            signature_pages.write = write
        assert stale != alone
        model.destroy_cached_continuous_batching_manager()


def test_forked_requests_copy_signatures(monkeypatch):
    """``num_return_sequences = 2`` forks each request after its prompt; the last, partial block is
    copied with its signatures. Sampling from the top token only is greedy decoding.

    transformers prefills all but the last prompt token before forking, so only that token's row is
    a final prompt chunk: ``sparse_prompt_tokens = 1`` makes the same rows sparse as ``generate``."""
    copied = []
    copy_blocks = signature_pages.SignaturePages.copy_blocks

    def recording(self, source_blocks, forked_blocks):
        copied.extend(forked_blocks)
        generator = torch.Generator().manual_seed(len(copied))
        for pages in self.layers.values():  # garbage in the fork's blocks, which the copy must replace
            blocks = pages.view(-1, self.block_size, *pages.shape[1:])
            for block in forked_blocks:
                blocks[block] = torch.randint(-2**31, 2**31 - 1, blocks[block].shape, generator=generator,
                                              dtype=torch.int32)
        copy_blocks(self, source_blocks, forked_blocks)

    monkeypatch.setattr(signature_pages.SignaturePages, "copy_blocks", recording)
    model = tiny_model("llama")
    requests = prompts((30, 37), seed=30)
    config = dataclasses.replace(SPARSE, sparse_prompt_tokens=1, local_tokens=1)
    with patch(model, tiny_adapters(model), config):
        generation = GenerationConfig(do_sample=True, top_k=1, pad_token_id=0, eos_token_id=-1,
                                      num_return_sequences=2)
        got = run_requests(model, requests, (8, 8), batching_config(block_size=8), generation=generation,
                           sequences=2)
        alone = [generate_alone(model, ids, 8) for ids in requests]
    assert copied
    assert got == {"r0": alone[0], "r0__child#0": alone[0], "r1": alone[1], "r1__child#0": alone[1]}


def _start(model):
    return model.init_continuous_batching(generation_config=GenerationConfig(eos_token_id=-1),
                                          continuous_batching_config=batching_config())


def test_sliding_window_set_after_patch_fails_at_start():
    model = tiny_model("mistral")
    with patch(model, tiny_adapters(model), SPARSE):
        model.config.sliding_window = 16
        with pytest.raises(ValueError, match="sliding_window=16"):
            _start(model)


def test_adapters_changed_after_patch_fail_at_start():
    model = tiny_model("llama")
    adapters = tiny_adapters(model)
    with patch(model, adapters, SPARSE):
        weights = adapters.layers[1].query.weights
        weights[0] = torch.nn.Parameter(weights[0].detach()[:, :32, :])
        with pytest.raises(ValueError, match="adapters layer 1 query weights have shapes"):
            _start(model)


def test_attention_switched_after_patch_fails_at_start():
    model = tiny_model("llama")
    with patch(model, tiny_adapters(model), SPARSE):
        model.set_attn_implementation("sdpa")
        with pytest.raises(ValueError, match="attention implementation is 'sdpa'"):
            _start(model)


def test_unpatch_removes_the_start_check():
    model = tiny_model("llama")
    with patch(model, tiny_adapters(model), SPARSE):
        assert "init_continuous_batching" in model.__dict__
    assert "init_continuous_batching" not in model.__dict__


def test_forward_outside_continuous_batching_is_an_error():
    model = tiny_model("llama")
    module = model.model.layers[0].self_attn
    query = torch.zeros(1, 4, 2, 64)
    with pytest.raises(ValueError, match="patched with hashattention.patch"):
        paged_hashattention_forward(module, query, query[:, :2], query[:, :2], None)
    with patch(model, tiny_adapters(model), SPARSE):
        model.set_attn_implementation(PAGED_ATTENTION_NAME)
        with pytest.raises(ValueError, match="without a paged attention cache"):
            model(torch.tensor([[3, 4, 5]]))
