"""The deferred stop check of a patched model's generate on CUDA: used, and the tokens unchanged."""

import pytest
import torch

import hashattention
from hashattention import GenerationOptions, HashAttentionConfig

from hf_models import random_ids, tiny_adapters, tiny_model

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and hashattention.WITH_CUDA),
                                reason="needs a CUDA device and the CUDA kernels")

CONFIG = HashAttentionConfig(budget_tokens=16, sink_tokens=4, local_tokens=4, sparse_prompt_tokens=4)


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("stops", [False, True])
def test_cuda_deferred_stop_check_keeps_the_tokens(monkeypatch, cache, stops):
    """With an end-of-sequence token that stops rows at different steps (and every row, before max_new_tokens)
    the deferred check runs one extra step and drops it: the tokens equal those of transformers' own check."""
    from transformers.generation import utils as generation_utils

    made = []
    original_init = generation_utils.DeferredStopCheck.__init__

    def counting_init(self, *args, **kwargs):
        made.append(True)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(generation_utils.DeferredStopCheck, "__init__", counting_init)
    model = tiny_model().cuda()
    adapters = tiny_adapters(model)
    ids = random_ids(3, 24, 5).cuda()
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    eos = None
    if stops:  # a token the first row generates early: it ends that row there, the others when they meet it
        with hashattention.patch(model, adapters, CONFIG, generation_options=GenerationOptions(compile_options=False)):
            eos = int(model.generate(ids, **kwargs)[0, 24 + 5])
    model.generation_config.eos_token_id = eos
    results = []
    for defer in (False, True):
        made.clear()
        options = GenerationOptions(compile_options=False, defer_stop_check=defer)
        with hashattention.patch(model, adapters, CONFIG, generation_options=options):
            results.append(model.generate(ids, **kwargs))
        assert bool(made) is defer
    assert torch.equal(results[0], results[1])
    if stops:
        assert (results[0][0, 24:] == eos).any()
