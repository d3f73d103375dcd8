"""An inductor graph pass for decoding with frozen weights: one GEMM for the projections of one input.

At decode time a Llama layer multiplies the same few rows by the q, k and v weights (and by the gate
and up weights): small GEMMs that each pay a launch, a split-K reduction and a bandwidth ramp. With
``torch._inductor.config.freezing = True`` inductor concatenates such weights itself, but before
torch 2.12 only when their shapes are equal, which leaves q | k | v apart under grouped-query
attention (k and v are narrower than q). This pass merges every group of ``aten.mm(x, W_i)`` that
share ``x`` and whose ``W_i`` are frozen constants with the same number of rows into one
``aten.mm(x, cat(W_i, dim=1))`` followed by column slices, on any torch version:

    import torch._inductor.config as inductor_config
    from hashattention.inductor_passes import ConcatProjections

    inductor_config.freezing = True                      # weights become constants (inference only)
    inductor_config.post_grad_custom_pre_pass = ConcatProjections()
    step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

(``hashattention.compile_options.decode_compile_options()`` returns these settings, with CUDA graphs and
programmatic dependent launch, as one ``options`` dict for ``torch.compile``.)

The concatenated weights are new constants beside the module's own parameters (the model stays
usable eagerly), so they cost their bytes once more: 1.6 GB for Llama-3.1-8B's q | k | v. Without
freezing the weights are graph inputs, not constants, and the pass changes nothing. It applies to
dense and HashAttention steps alike; the decode benchmark uses it for both
(``python -m benchmarks.decode_loop``, by default with the kept layout).

Weight layout. Frozen ``nn.Linear`` weights reach the GEMM as transposed views (column-major
``(in, out)``), which cuBLAS runs as "TN" kernels. ``layout="keep"`` (the default) concatenates
column-major members column-major, so the merged GEMM stays a TN kernel like the ones it replaces;
``layout="row_major"`` stores the concatenation row-major, an "NN" kernel. On an H100 at B = 2 / 128K
(Llama-3.1-8B shape) cuBLAS ran the kept layout without split-K (19.9 µs per layer, one reduction
launch fewer) and the row-major one with it (19.3 µs plus the reduction): HashAttention's decode step
8.475 against 8.510 ms, dense's level (17.382 / 17.376). Either merge beats the three separate GEMMs
(~22 µs per layer).
"""

from __future__ import annotations

import collections
from typing import Dict, List, Tuple

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

_MM = torch.ops.aten.mm.default
_SLICE = torch.ops.aten.slice.Tensor
_NAME_PREFIX = "_hashattention_concat_weight"


LAYOUTS = ("row_major", "keep")


class ConcatProjections(CustomGraphPass):
    """``torch._inductor.config.post_grad_custom_pre_pass`` value running
    :func:`concat_shared_input_projections` with ``layout`` (cacheable: its identity is this file's hash
    and the layout)."""

    def __init__(self, layout: str = "keep"):
        _check_layout(layout)
        self.layout = layout

    def __call__(self, graph: torch.fx.Graph) -> None:
        concat_shared_input_projections(graph, self.layout)

    def uuid(self):
        return (get_hash_for_files((__file__,)), self.layout)

    # Equal by layout: transformers deep-copies the generation config (and its compile options) on
    # every generate call and compiles anew when the copy differs from the last call's.
    def __eq__(self, other) -> bool:
        return isinstance(other, ConcatProjections) and other.layout == self.layout

    def __hash__(self) -> int:
        return hash((ConcatProjections, self.layout))


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _concatenate(weights: List[torch.Tensor], layout: str) -> torch.Tensor:
    """The ``(rows, sum of widths)`` concatenation of ``weights`` along dim 1: column-major when ``layout`` is
    "keep" and every weight is column-major (a transposed contiguous tensor), row-major otherwise."""
    if layout == "keep" and all(w.t().is_contiguous() for w in weights):
        return torch.cat([w.t() for w in weights], dim=0).t()
    return torch.cat(weights, dim=1)


def _constant_weight(module: torch.nn.Module, node: torch.fx.Node):
    """The 2-D tensor a ``get_attr`` node names, or None."""
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    value = module
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value if isinstance(value, torch.Tensor) and value.dim() == 2 else None


def _fake(node: torch.fx.Node):
    value = node.meta.get("val")
    return value if isinstance(value, torch._subclasses.FakeTensor) else None


def concat_shared_input_projections(graph: torch.fx.Graph, layout: str = "keep") -> int:
    """Rewrites ``graph`` in place and returns how many groups of GEMMs it merged.

    A group is two or more ``aten.mm(x, W_i)`` nodes with the same ``x`` node and constant ``W_i``
    (``get_attr`` nodes of the owning module, as freezing leaves them) of equal row count, dtype and
    device. Each group becomes one GEMM over a new constant ``cat(W_i, dim=1)`` placed before the
    group's first member, and each member's users read ``mm[:, offset_i : offset_i + N_i]`` instead.
    ``layout`` ("keep", the default, or "row_major") is the new constant's memory layout (the module docstring says why).
    """
    _check_layout(layout)
    module = graph.owning_module
    if module is None:
        return 0
    groups: Dict[Tuple, List[Tuple[torch.fx.Node, torch.Tensor]]] = collections.defaultdict(list)
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not _MM or len(node.args) != 2 or node.kwargs:
            continue
        x, w = node.args
        weight = _constant_weight(module, w)
        if weight is None or not isinstance(x, torch.fx.Node):
            continue
        groups[(x, weight.shape[0], weight.dtype, weight.device)].append((node, weight))

    merged = 0
    for (x, _, _, _), members in groups.items():
        if len(members) < 2:
            continue
        first = members[0][0]  # graph order: x and every member's inputs exist before it
        name = f"{_NAME_PREFIX}{merged}"
        while hasattr(module, name):
            name += "_"
        concatenated = _concatenate([weight for _, weight in members], layout)
        module.register_buffer(name, concatenated)
        fake_x = _fake(x)
        pieces = []
        with graph.inserting_before(first):
            constant = graph.get_attr(name)
            product = graph.call_function(_MM, (x, constant))
            if fake_x is not None:
                with fake_x.fake_mode:
                    # A constant's sizes never change: without static_shapes a mode with a shape environment
                    # would give it new symbols, which code generated for a consumer can name but not bind.
                    constant.meta["val"] = fake_x.fake_mode.from_tensor(concatenated, static_shapes=True)
                    product.meta["val"] = torch.mm(fake_x, constant.meta["val"])
            start = 0
            for _, weight in members:
                width = weight.shape[1]
                piece = graph.call_function(_SLICE, (product, 1, start, start + width))
                if fake_x is not None:
                    with fake_x.fake_mode:
                        piece.meta["val"] = product.meta["val"][:, start : start + width]
                pieces.append(piece)
                start += width
        # Only now, outside the insertion point: erasing `first` inside it would link later nodes
        # to an erased node and corrupt the graph's node list.
        for (node, _), piece in zip(members, pieces):
            old_weight = node.args[1]
            node.replace_all_uses_with(piece)
            graph.erase_node(node)
            if not old_weight.users:
                graph.erase_node(old_weight)
        merged += 1
    return merged
