"""hashattention.inductor_passes: one GEMM for the projections that read the same input (CPU)."""

import collections
import re

import pytest
import torch
import torch._inductor.config as inductor_config
from torch.torch_version import TorchVersion
from torch._inductor.utils import run_and_get_code

from hashattention.config import HashAttentionConfig
from hashattention.inductor_passes import ConcatProjections, concat_shared_input_projections
from hashattention.patching import patch

from hf_models import random_ids, tiny_adapters, tiny_model
from test_hf_integration import LOGIT_TOLERANCE, PROMPT, make_cache

aten = torch.ops.aten


def projection_graph(weights, inputs=("x",), placeholder_weights=(), column_major=False):
    """A GraphModule computing aten.mm(input, weight) for every (input, weight name) pair in ``weights``
    (a list); weights are buffers (get_attr) unless named in ``placeholder_weights`` (graph inputs), and
    transposed contiguous tensors (as frozen nn.Linear weights are) with ``column_major``."""
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    nodes = {name: graph.placeholder(name) for name in inputs}
    outputs = []
    for input_name, weight_name, shape in weights:
        if weight_name in placeholder_weights:
            if weight_name not in nodes:
                nodes[weight_name] = graph.placeholder(weight_name)
            weight = nodes[weight_name]
        else:
            if not hasattr(root, weight_name):
                value = torch.randn(*shape[::-1], dtype=torch.float64).t() if column_major else \
                    torch.randn(*shape, dtype=torch.float64)
                root.register_buffer(weight_name, value)
            weight = graph.get_attr(weight_name)
        outputs.append(graph.call_function(aten.mm.default, (nodes[input_name], weight)))
    graph.output(tuple(outputs))
    return torch.fx.GraphModule(root, graph)


def mm_count(module):
    return sum(1 for n in module.graph.nodes if n.op == "call_function" and n.target is aten.mm.default)


@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("layout", ["row_major", "keep"])
def test_groups_of_a_shared_input_become_one_gemm_with_the_same_results(layout, column_major):
    """q | k | v (unequal widths, as under grouped-query attention) merge into one GEMM; a second input's
    pair merges on its own; every output equals the separate products. The new constants are column-major
    only with layout="keep" and column-major members."""
    module = projection_graph([("x", "wq", (16, 12)), ("x", "wk", (16, 4)), ("x", "wv", (16, 4)),
                               ("y", "wg", (16, 8)), ("y", "wu", (16, 8))], inputs=("x", "y"),
                              column_major=column_major)
    x, y = torch.randn(3, 16, dtype=torch.float64), torch.randn(3, 16, dtype=torch.float64)
    expected = module(x, y)
    assert concat_shared_input_projections(module.graph, layout) == 2
    module.graph.lint()
    module.recompile()
    assert mm_count(module) == 2
    keeps_columns = layout == "keep" and column_major
    # bit-equal when the merged weight has the members' layout; a changed layout may change the BLAS
    # summation order, so then only float64 rounding apart
    exact = keeps_columns or not column_major
    for got, want in zip(module(x, y), expected):
        torch.testing.assert_close(got, want, **(dict(rtol=0, atol=0) if exact else {}))
    assert not any(n.op == "get_attr" and n.target in ("wq", "wk", "wv", "wg", "wu") for n in module.graph.nodes)
    constants = [getattr(module, n.target) for n in module.graph.nodes if n.op == "get_attr"]
    assert [tuple(c.shape) for c in constants] == [(16, 20), (16, 16)]
    assert all(c.t().is_contiguous() if keeps_columns else c.is_contiguous() for c in constants)


def test_an_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="layout must be one of"):
        ConcatProjections(layout="transposed")
    with pytest.raises(ValueError, match="layout must be one of"):
        concat_shared_input_projections(projection_graph([("x", "wq", (4, 4))]).graph, "column")


@pytest.mark.parametrize(
    "weights, placeholders",
    [
        ([("x", "wq", (16, 12))], ()),                                    # alone
        ([("x", "wq", (16, 12)), ("x", "wk", (8, 4))], ()),               # different row counts
        ([("x", "wq", (16, 12)), ("x", "wk", (16, 4))], ("wk",)),         # one weight is a graph input
        ([("x", "wq", (16, 12)), ("y", "wk", (16, 4))], ()),              # different inputs
    ],
)
def test_gemms_that_do_not_qualify_stay_apart(weights, placeholders):
    inputs = tuple(sorted({w[0] for w in weights}))
    module = projection_graph(weights, inputs=inputs, placeholder_weights=placeholders)
    assert concat_shared_input_projections(module.graph) == 0
    assert mm_count(module) == len(weights)


def compare_decode_step(patched: bool, layers: int, run_compiled, seed: int = 6):
    """One static-cache decode step of a tiny Llama (plain or HashAttention-patched), eagerly and through
    ``run_compiled(forward, args, kwargs) -> (output, extra)`` on a second cache filled by the same prompt;
    asserts the logits agree and returns ``extra``."""
    model = tiny_model("llama", layers=layers)
    ids = random_ids(2, PROMPT, seed=seed)
    step_kwargs = dict(use_cache=True, cache_position=torch.tensor([PROMPT]))
    context = patch(model, tiny_adapters(model), HashAttentionConfig(sink_tokens=4, local_tokens=4, budget_tokens=8)) \
        if patched else torch.no_grad()
    with context, torch.no_grad():
        caches = [make_cache("static", model, PROMPT + 2) for _ in range(2)]
        for cache in caches:
            model(ids, past_key_values=cache, use_cache=True)
        eager = model(ids[:, -1:], past_key_values=caches[0], **step_kwargs).logits
        torch._dynamo.reset()
        out, extra = run_compiled(model.forward, (ids[:, -1:],), dict(past_key_values=caches[1], **step_kwargs))
        torch._dynamo.reset()
    torch.testing.assert_close(out.logits, eager, **LOGIT_TOLERANCE)
    return extra


def frozen_step_gemms(patched: bool, layers: int, options: dict) -> int:
    """GEMM calls in the generated code of a compiled static-cache decode step of a tiny Llama (plain or
    HashAttention-patched) under inductor ``options``; asserts the step's logits equal eager's."""
    def run(forward, args, kwargs):
        # weight_prepack off: on the CPU the GEMMs then stay aten mm calls that the generated code names
        with inductor_config.patch({**options, "cpp.weight_prepack": False}):
            return run_and_get_code(torch.compile(forward, fullgraph=True), *args, **kwargs)

    code = compare_decode_step(patched, layers, run)
    return sum(collections.Counter(re.findall(r"extern_kernels\.(mm|addmm)\(", "\n".join(code))).values())


@pytest.mark.parametrize("patched", [False, True])
def test_frozen_decode_step_runs_four_gemms_per_layer_and_matches_eager(patched):
    """With freezing and the pass (inductor's own concatenation off, as it is on the CPU without
    cpp.enable_concat_linear and, for unequal widths, before torch 2.12), a 2-layer decode step runs
    q|k|v, o, gate|up and down per layer plus lm_head: 9 GEMMs instead of 15, and the same logits as
    eager, for the plain model and the HashAttention-patched one alike, with either weight layout."""
    frozen = {"freezing": True, "cpp.enable_concat_linear": False}
    assert frozen_step_gemms(patched, 2, frozen) == 15
    for layout in ("row_major", "keep"):
        assert frozen_step_gemms(patched, 2, {**frozen, "post_grad_custom_pre_pass": ConcatProjections(layout)}) == 9


def test_inductor_freezing_alone_merges_what_this_torch_version_allows():
    """Inductor's own freezing pattern (no pass) concatenates gate | up always and q | k | v only from torch
    2.12 (before, only weights of equal shape): 5 or 6 GEMMs per 1-layer patched step instead of 8. The
    patched step stays one graph whose adapters and ops survive the constant folding."""
    native = {"cpp.enable_concat_linear": True}
    assert frozen_step_gemms(True, 1, {**native, "freezing": False}) == 8
    merges_unequal_widths = TorchVersion(torch.__version__) >= "2.12"
    assert frozen_step_gemms(True, 1, {**native, "freezing": True}) == (5 if merges_unequal_widths else 6)


def test_the_pass_identifies_itself_and_its_layout_for_the_compile_cache():
    assert ConcatProjections().uuid() == ConcatProjections("keep").uuid() is not None  # the default layout
    assert ConcatProjections("row_major").uuid() != ConcatProjections().uuid()


def test_the_merged_constant_has_static_sizes_under_a_shape_environment():
    """With dynamic shapes the graph's fake mode has a shape environment; the merged weight's fake value must
    still have plain int sizes (a symbol there is one that code generated for its consumers cannot bind)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    module = projection_graph([("x", "wq", (16, 12)), ("x", "wk", (16, 4))], column_major=True)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = next(n for n in module.graph.nodes if n.op == "placeholder")
    x.meta["val"] = mode.from_tensor(torch.randn(3, 16, dtype=torch.float64), static_shapes=True)
    assert concat_shared_input_projections(module.graph, "keep") == 1
    constants = [n for n in module.graph.nodes if n.op == "get_attr"]
    assert len(constants) == 1
    assert all(type(size) is int for size in constants[0].meta["val"].shape)
