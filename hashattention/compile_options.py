"""Inductor options for the fastest compiled decode step, in one dict.

``torch.compile`` takes either a ``mode`` or an ``options`` dict, not both, so the settings measured
by the decode benchmark (``python -m benchmarks.decode_loop``) are gathered here as options
(``mode="reduce-overhead"`` is the option ``triton.cudagraphs``)::

    from hashattention.compile_options import decode_compile_options

    with torch.no_grad():                     # freezing applies to inference only
        step = torch.compile(model.forward, fullgraph=True, options=decode_compile_options())
        out = step(input_ids=..., past_key_values=static_cache, ...)

What each option bought on Llama-3.1-8B decode at 128K, 32x per query head (docs/benchmarks.md):

* ``triton.cudagraphs``: the step as one CUDA graph (what ``mode="reduce-overhead"`` sets);
* ``triton.enable_pdl``: inductor's Triton kernels launched programmatically (sm_90 and later; inductor
  leaves it off elsewhere): H200, B = 4, 8.63 -> 8.49 ms per step;
* ``freezing`` with :class:`hashattention.inductor_passes.ConcatProjections`: weights as constants,
  gate | up and q | k | v each one GEMM: H100, B = 2, 8.86 -> 8.52 ms per step with the row-major
  merge, and the kept layout 0.035 ms less again on another H100; H200, B = 4, all three options:
  7.97 ms per step against dense's 20.12 (2.52x; 8.49 / 21.13 without freezing). It costs the concatenated
  weights' bytes once more (9 GB for Llama-3.1-8B) and ~25 s more compile time.

The options apply to a dense model as much as to a patched one.
"""

from __future__ import annotations

from typing import Dict

from .inductor_passes import ConcatProjections, _check_layout


def decode_compile_options(cuda_graphs: bool = True, pdl: bool = True, freeze: bool = True,
                           merge_projections: bool = True, layout: str = "keep") -> Dict[str, object]:
    """The ``options`` dict for ``torch.compile`` of a decode step.

    Args:
        cuda_graphs: capture the step as a CUDA graph (``mode="reduce-overhead"``); CPU graphs are
            compiled without one.
        pdl: programmatic dependent launch for inductor's Triton kernels (used on sm_90 and later only).
        freeze: weights become graph constants (``freezing``); compile and call the step under
            ``torch.no_grad()``, and recompile after changing the weights.
        merge_projections: merge the GEMMs that read the same input (q | k | v) with
            :class:`~hashattention.inductor_passes.ConcatProjections`; needs ``freeze``.
        layout: the merged weights' memory layout, ``"keep"`` (column-major like the frozen weights)
            or ``"row_major"``.

    Returns:
        ``{option name: value}`` for ``torch.compile(..., options=...)`` (or ``torch._inductor.config.patch``).

    Raises:
        ValueError: ``merge_projections`` without ``freeze``, or an unknown ``layout``.
    """
    if merge_projections and not freeze:
        raise ValueError("merge_projections=True needs freeze=True: without freezing the weights are graph "
                         "inputs, not constants, and nothing can be merged")
    _check_layout(layout)  # also when nothing is merged: a wrong name is refused either way
    options: Dict[str, object] = {"triton.cudagraphs": cuda_graphs, "triton.enable_pdl": pdl, "freezing": freeze}
    if merge_projections:
        options["post_grad_custom_pre_pass"] = ConcatProjections(layout)
    return options
