"""hashattention.generation: what patch changes about model.generate, and that tokens do not change (CPU; the
deferred stop check, CUDA only, in test_generation_options_cuda)."""

import pytest
import torch
from torch._dynamo.utils import counters

import hashattention
from hashattention import GenerationOptions, HashAttentionConfig, generation
from hashattention.cache import SignatureStaticLayer
from hashattention.inductor_passes import ConcatProjections

from hf_models import random_ids, tiny_adapters, tiny_model

CONFIG = HashAttentionConfig(budget_tokens=16, sink_tokens=4, local_tokens=4, sparse_prompt_tokens=4)
OFF = GenerationOptions(compile_options=False, cache_bucket_tokens=0, defer_stop_check=False)


def generate(model, ids, new_tokens, **kwargs):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                          cache_implementation="static", **kwargs)


def compile_on_cpu(model):
    """Let transformers compile generate's decode step on the CPU, with the patch's options."""
    config = model.generation_config.compile_config
    # See test_hf_compile_options: CPU freezing with weight prepacking changes later tests' GEMMs.
    config.options = {**config.options, "cpp.weight_prepack": False}
    config._compile_all_devices = True


def graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def test_patch_sets_and_unpatch_restores_the_generation_settings():
    model, adapters = tiny_model(), None
    adapters = tiny_adapters(model)
    before = model.generation_config.compile_config
    with hashattention.patch(model, adapters, CONFIG) as handle:
        config = model.generation_config.compile_config
        assert config is not before and config.fullgraph and config.dynamic is False and config.mode is None
        assert config.options["freezing"] is True and isinstance(config.options["post_grad_custom_pre_pass"],
                                                                  ConcatProjections)
        assert "_prepare_static_cache" in model.__dict__
        assert handle.generation_options == GenerationOptions()
        model._compiled_call = "compiled while patched"  # what generate leaves behind
    assert model.generation_config.compile_config is before
    assert "_prepare_static_cache" not in model.__dict__ and "_compiled_call" not in model.__dict__
    with hashattention.patch(model, adapters, CONFIG, generation_options=OFF):
        assert model.generation_config.compile_config is before
        assert "_prepare_static_cache" not in model.__dict__


def test_merged_projection_passes_compare_equal_after_a_deep_copy():
    """generate deep-copies its generation config; a copy that compared unequal would recompile every call."""
    import copy

    config = GenerationOptions().compile_config()
    assert copy.deepcopy(config) == config
    assert ConcatProjections("keep") != ConcatProjections("row_major")


@pytest.mark.parametrize("length, bucket, expected", [(1, 4096, 4096), (4096, 4096, 4096), (4097, 4096, 8192),
                                                      (131144, 4096, 135168), (77, 0, 77), (77, 32, 96)])
def test_bucketed_length(length, bucket, expected):
    assert generation.bucketed_length(length, bucket) == expected


def test_static_cache_is_sized_in_buckets_and_reused():
    model = tiny_model()
    with hashattention.patch(model, tiny_adapters(model), CONFIG,
                             generation_options=GenerationOptions(compile_options=False, cache_bucket_tokens=64)):
        first = generate(model, random_ids(1, 20, 0), 5, return_dict_in_generate=True).past_key_values
        layer = first.layers[0]
        assert isinstance(layer, SignatureStaticLayer) and layer.max_cache_len == 64
        again = generate(model, random_ids(1, 30, 1), 9, return_dict_in_generate=True).past_key_values
        assert again is first and int(layer.cumulative_length) == 30 + 9 - 1
        larger = generate(model, random_ids(1, 70, 1), 5, return_dict_in_generate=True).past_key_values
        assert larger is not first and larger.layers[0].max_cache_len == 128
        other_batch = generate(model, random_ids(2, 20, 1), 5, return_dict_in_generate=True).past_key_values
        assert other_batch is not larger and other_batch.layers[0].max_cache_len == 128


def test_a_reused_cache_keeps_nothing_of_the_previous_call():
    """Tokens of a call that reuses the cache equal those of the same call on a fresh patch."""
    model = tiny_model()
    adapters = tiny_adapters(model)
    prompts = [random_ids(2, 40, 3), random_ids(2, 25, 4)]
    with hashattention.patch(model, adapters, CONFIG, generation_options=GenerationOptions(compile_options=False)):
        reused = [generate(model, ids, 10) for ids in prompts]
    for ids, tokens in zip(prompts, reused):
        with hashattention.patch(model, adapters, CONFIG, generation_options=OFF):
            assert torch.equal(generate(model, ids, 10), tokens)


@pytest.mark.parametrize("options", [
    GenerationOptions(compile_options=False),
    GenerationOptions(compile_options=False, cache_bucket_tokens=0),
    GenerationOptions(compile_options=False, cache_bucket_tokens=96, defer_stop_check=False),
])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_eager_tokens_do_not_depend_on_the_options(options, kind):
    """Greedy tokens with buckets (a larger cache, more slots beyond every length) equal those without, for a
    left-padded batch whose rows stop at an end-of-sequence token at different steps."""
    model = tiny_model(kind)
    adapters = tiny_adapters(model)
    ids = random_ids(3, 24, 5)
    ids[1, :6] = 0  # left padding
    mask = (ids != 0).long()
    model.generation_config.eos_token_id = 9
    results = []
    for chosen in (OFF, options):
        with hashattention.patch(model, adapters, CONFIG, generation_options=chosen):
            results.append(model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                          cache_implementation="static"))
    assert torch.equal(results[0], results[1])


@pytest.mark.slow
def test_compiled_generate_matches_eager_and_reuses_the_step_within_a_bucket():
    """With the patch's compile settings (freezing, merged projections) generate's tokens equal eager's, and a
    call with a shorter prompt and more new tokens in the same cache bucket compiles nothing new."""
    torch._dynamo.reset()
    model = tiny_model()
    adapters = tiny_adapters(model)
    ids = random_ids(2, 20, 0)
    with hashattention.patch(model, adapters, CONFIG, generation_options=OFF):
        eager = generate(model, ids, 8)
        eager_longer = generate(model, ids[:, :15], 20)
    with hashattention.patch(model, adapters, CONFIG):
        compile_on_cpu(model)
        compiled = generate(model, ids, 8)
        compiled_graphs = graphs()
        compiled_longer = generate(model, ids[:, :15], 20)
        assert graphs() == compiled_graphs
    assert torch.equal(eager, compiled) and torch.equal(eager_longer, compiled_longer)


@pytest.mark.slow
def test_without_buckets_a_longer_call_compiles_again():
    """The control of the test above: transformers' own sizes (no bucket) give a new cache shape, so a new graph."""
    torch._dynamo.reset()
    model = tiny_model()
    with hashattention.patch(model, tiny_adapters(model), CONFIG,
                             generation_options=GenerationOptions(cache_bucket_tokens=0)):
        compile_on_cpu(model)
        generate(model, random_ids(2, 20, 0), 8)
        before = graphs()
        generate(model, random_ids(2, 15, 0), 20)
        assert graphs() > before


class _Cache:
    def __init__(self, croppable: bool, marked: bool):
        self.is_croppable = croppable
        if marked:
            setattr(self, generation.DEFER_STOP_CHECK_ATTRIBUTE, True)


@pytest.mark.parametrize("device, croppable, marked, returned, assistant, expected", [
    ("cuda", False, True, False, False, True),
    ("cuda", True, True, True, False, True),
    ("cuda", False, True, True, False, False),   # returned and not croppable: the extra step could not be undone
    ("cuda", False, False, False, False, False),  # not a patched model's cache
    ("cuda", False, True, False, True, False),    # assistant models keep transformers' check
    ("cpu", False, True, False, False, False),    # transformers' deferred check needs device events
])
def test_deferred_stop_check_condition(device, croppable, marked, returned, assistant, expected):
    cache = _Cache(croppable, marked)
    assert generation.defers_stop_check(torch.device(device), cache, returned, assistant) is expected
    assert generation.install_deferred_stop_check()
    from transformers.generation.utils import DeferredStopCheck

    assert DeferredStopCheck.is_supported(torch.device(device), cache, returned, is_assistant=assistant) is expected


def test_patch_marks_the_cache_only_when_asked():
    model = tiny_model()
    adapters = tiny_adapters(model)
    ids = random_ids(1, 12, 0)
    for options, marked in ((GenerationOptions(compile_options=False), True), (OFF, False)):
        with hashattention.patch(model, adapters, CONFIG, generation_options=options):
            out = generate(model, ids, 2, return_dict_in_generate=True)
        assert getattr(out.past_key_values, generation.DEFER_STOP_CHECK_ATTRIBUTE, False) is marked


@pytest.mark.parametrize("arguments, message", [
    (dict(freeze=False), "merge_projections=True needs freeze=True"),
    (dict(cache_bucket_tokens=-1), "cache_bucket_tokens must be an int in"),
    (dict(cache_bucket_tokens=1.5), "cache_bucket_tokens must be an int"),
    (dict(defer_stop_check=1), "defer_stop_check must be a bool"),
])
def test_bad_options_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        GenerationOptions(**arguments)


def test_patch_refuses_options_of_another_type():
    model = tiny_model()
    with pytest.raises(ValueError, match="generation_options must be a GenerationOptions"):
        hashattention.patch(model, tiny_adapters(model), CONFIG, generation_options={"compile_options": False})
    assert not hashattention.is_patched(model)
