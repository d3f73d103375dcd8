"""hashattention.compile_options: the decode step's inductor options, accepted by torch.compile (CPU)."""

import pytest
import torch

from hashattention.compile_options import decode_compile_options
from hashattention.inductor_passes import ConcatProjections

from test_hf_inductor_passes import compare_decode_step, frozen_step_gemms


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
    def run(forward, args, kwargs):
        # weight_prepack off: a CPU freezing compile with it registers mkldnn weight packing for the rest of the
        # process, which would turn later tests' GEMMs into mkl calls that their code checks do not count.
        options = {**decode_compile_options(), "cpp.weight_prepack": False}
        step = torch.compile(forward, fullgraph=True, options=options)
        return step(*args, **kwargs), None

    compare_decode_step(patched, 2, run, seed=7)


def test_the_options_merge_the_projections():
    """With inductor's own CPU concatenation off, the options' pass leaves 4 GEMMs per layer plus lm_head."""
    own_concat_off = {"cpp.enable_concat_linear": False}
    assert frozen_step_gemms(True, 2, {**decode_compile_options(cuda_graphs=False), **own_concat_off}) == 9
    unmerged = decode_compile_options(cuda_graphs=False, merge_projections=False)
    assert frozen_step_gemms(True, 2, {**unmerged, **own_concat_off}) == 15
