"""hashattention.compile_options: the decode step's inductor options, accepted by torch.compile (CPU)."""

import pytest
import torch

from hashattention.compile_options import decode_compile_options
from hashattention.config import HashAttentionConfig
from hashattention.inductor_passes import ConcatProjections
from hashattention.patching import patch

from hf_models import random_ids, tiny_adapters, tiny_model
from test_inductor_passes import frozen_step_gemms
from test_integration import LOGIT_TOLERANCE, PROMPT, make_cache


def test_default_options_and_their_switches():
    options = decode_compile_options()
    assert {k: v for k, v in options.items() if k != "post_grad_custom_pre_pass"} == {
        "triton.cudagraphs": True, "triton.enable_pdl": True, "freezing": True}
    assert isinstance(options["post_grad_custom_pre_pass"], ConcatProjections)
    assert options["post_grad_custom_pre_pass"].layout == "keep"
    assert decode_compile_options(layout="row_major")["post_grad_custom_pre_pass"].layout == "row_major"
    plain = decode_compile_options(cuda_graphs=False, pdl=False, freeze=False, merge_projections=False)
    assert plain == {"triton.cudagraphs": False, "triton.enable_pdl": False, "freezing": False}


@pytest.mark.parametrize("arguments, message", [
    (dict(freeze=False), "merge_projections=True needs freeze=True"),
    (dict(layout="column"), "layout must be one of"),
])
def test_bad_combinations_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        decode_compile_options(**arguments)


@pytest.mark.parametrize("patched", [False, True])
def test_torch_compile_takes_the_options_and_the_step_matches_eager(patched):
    """torch.compile(..., options=decode_compile_options()) compiles a static-cache decode step of a tiny Llama
    (dense or HashAttention-patched; CUDA graphs do not apply on the CPU) to eager's logits."""
    model = tiny_model("llama", layers=2)
    ids = random_ids(2, PROMPT, seed=7)
    step_kwargs = dict(use_cache=True, cache_position=torch.tensor([PROMPT]))
    context = patch(model, tiny_adapters(model), HashAttentionConfig(sink_tokens=4, local_tokens=4, budget_tokens=8)) \
        if patched else torch.no_grad()
    with context, torch.no_grad():
        caches = [make_cache("static", model, PROMPT + 2) for _ in range(2)]
        for cache in caches:
            model(ids, past_key_values=cache, use_cache=True)
        eager = model(ids[:, -1:], past_key_values=caches[0], **step_kwargs).logits
        torch._dynamo.reset()
        # weight_prepack off: a CPU freezing compile with it registers mkldnn weight packing for the rest of the
        # process, which would turn later tests' GEMMs into mkl calls that their code checks do not count.
        step = torch.compile(model.forward, fullgraph=True,
                             options={**decode_compile_options(), "cpp.weight_prepack": False})
        compiled = step(ids[:, -1:], past_key_values=caches[1], **step_kwargs).logits
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, **LOGIT_TOLERANCE)


def test_the_options_merge_the_projections():
    """With inductor's own CPU concatenation off, the options' pass leaves 4 GEMMs per layer plus lm_head."""
    assert frozen_step_gemms(True, 2, {**decode_compile_options(cuda_graphs=False), "cpp.enable_concat_linear": False}) == 9
    assert frozen_step_gemms(True, 2, {**decode_compile_options(cuda_graphs=False, merge_projections=False),
                                       "cpp.enable_concat_linear": False}) == 15
