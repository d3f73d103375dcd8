"""How a patched model's ``model.generate`` runs: compile settings, cache sizes and stop checks.

:func:`hashattention.patch` applies :class:`GenerationOptions` (default: all on) so that
``model.generate(..., cache_implementation="static")`` decodes at the speed of the hand-built decode
loop of ``python -m benchmarks.decode_loop``, and :func:`hashattention.unpatch` undoes them:

* **compile settings**: transformers compiles a static-cache decode step with
  ``generation_config.compile_config`` (default: ``mode="reduce-overhead"``). The patch sets it to
  :func:`hashattention.compile_options.decode_compile_options`: CUDA graphs, programmatic launch of
  inductor's kernels, frozen weights with merged q | k | v and gate | up projections (see that module
  for what each bought). The merged weights cost their bytes once more (9.1 GB for Llama-3.1-8B in
  bf16: 1.6 GB of q | k | v, 7.5 GB of gate | up) and freezing ~25 s more compile time;
  ``GenerationOptions(merge_projections=False)`` keeps the memory, ``compile_options=False`` leaves
  transformers' setting alone. A ``compile_config`` passed to ``generate`` wins over the patch's.
* **one static cache, sized in buckets**: transformers creates a fresh static cache for every call,
  sized to the prompt plus ``max_new_tokens`` (never smaller than an earlier call's). Every new size
  compiles the decode step anew (38-50 s for Llama-3.1-8B), and every new cache moves the tensors
  the step's CUDA graphs were recorded on (K/V at fixed addresses), so each call records its graphs
  again and holds a second cache while the first is released. The patch rounds the size up to a
  multiple of ``cache_bucket_tokens`` (default 4096) and keeps the cache between calls: a call of the
  same batch size within the bucket resets and reuses it (the decode step's graphs replay as they
  are); a larger call replaces it. ``unpatch`` drops it. A cache returned by ``generate``
  (``return_dict_in_generate=True``) is that same object, reset by the next call.
* **deferred stop checks**: after every token transformers reads ``unfinished_sequences.max() == 0``
  on the host, which waits for the GPU to finish the step before the next one is issued, so the
  host's share of each step (the loop's Python, logits processing, the graph launch) adds to the GPU
  time instead of overlapping it. transformers has a deferred check (read one step late; one extra
  step run and dropped when an end-of-sequence token stops every sequence) but enables it on Apple
  GPUs only; the patch enables it on CUDA for caches that hold HashAttention's signature layers.
  Generated tokens are the same either way.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from transformers.utils import is_torchdynamo_compiling

from .compile_options import decode_compile_options
from .config import checked_int

#: Cache attribute set by the patch's pre-hook when the patched model asked for deferred stop checks.
DEFER_STOP_CHECK_ATTRIBUTE = "_hashattention_defer_stop_check"


@dataclasses.dataclass(frozen=True)
class GenerationOptions:
    """What :func:`hashattention.patch` changes about ``model.generate`` (all on by default).

    Attributes:
        compile_options: set ``model.generation_config.compile_config`` to the decode-step options
            of :func:`~hashattention.compile_options.decode_compile_options` (False: keep the model's).
        freeze: frozen weights in the compiled decode step (needs ``compile_options``).
        merge_projections: merged q | k | v and gate | up GEMMs (needs ``freeze``); costs those
            weights' bytes once more.
        cache_bucket_tokens: round static caches that ``generate`` creates up to a multiple of this
            many slots, and reuse the cache across calls that fit it (0: transformers' sizes and a
            new cache per call).
        defer_stop_check: read the stop condition one step late on CUDA (no host wait per token).
    """

    compile_options: bool = True
    freeze: bool = True
    merge_projections: bool = True
    cache_bucket_tokens: int = 4096
    defer_stop_check: bool = True

    def __post_init__(self):
        for name in ("compile_options", "freeze", "merge_projections", "defer_stop_check"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GenerationOptions.{name} must be a bool, got {getattr(self, name)!r}")
        checked_int("GenerationOptions.cache_bucket_tokens", self.cache_bucket_tokens, minimum=0)
        if self.merge_projections and not self.freeze:
            raise ValueError("GenerationOptions: merge_projections=True needs freeze=True (only frozen weights "
                             "can be merged); pass merge_projections=False too")

    def compile_config(self):
        """The ``transformers.CompileConfig`` of the decode step (None with ``compile_options=False``)."""
        if not self.compile_options:
            return None
        from transformers import CompileConfig

        # torch.compile takes a mode or an options dict, not both: the options include what
        # mode="reduce-overhead" sets (CUDA graphs). dynamic=False: one graph per cache shape, as
        # CUDA graphs need; the buckets keep the shapes few.
        options = decode_compile_options(freeze=self.freeze, merge_projections=self.merge_projections)
        return CompileConfig(fullgraph=True, dynamic=False, mode=None, options=options)


def bucketed_length(length: int, bucket: int) -> int:
    """``length`` rounded up to a multiple of ``bucket`` (``length`` itself when ``bucket`` is 0)."""
    if bucket <= 0:
        return length
    return -(-length // bucket) * bucket


@dataclasses.dataclass
class GenerationState:
    """What :func:`apply` changed on a model, for :func:`restore`, and the static cache kept between calls."""

    compile_config: Any
    had_compile_config: bool
    bucketed_static_cache: bool
    static_cache: Any = None


def apply(model, options: GenerationOptions) -> GenerationState:
    """Apply ``options`` to ``model`` (a transformers ``GenerationMixin``); returns what :func:`restore` needs."""
    generation_config = getattr(model, "generation_config", None)
    had = generation_config is not None and hasattr(generation_config, "compile_config")
    state = GenerationState(compile_config=getattr(generation_config, "compile_config", None), had_compile_config=had,
                            bucketed_static_cache=False)
    if generation_config is not None and options.compile_options:
        generation_config.compile_config = options.compile_config()
    _drop_compiled_call(model)  # compiled before the patch: it holds the unpatched attention
    if options.cache_bucket_tokens and hasattr(type(model), "_prepare_static_cache"):
        prepare = type(model)._prepare_static_cache.__get__(model)
        model._prepare_static_cache = functools.partial(_prepare_bucketed_cache, model, state, prepare,
                                                        options.cache_bucket_tokens)
        state.bucketed_static_cache = True
    if options.defer_stop_check:
        install_deferred_stop_check()
    return state


def restore(model, state: GenerationState) -> None:
    """Undo :func:`apply`."""
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        if state.had_compile_config:
            generation_config.compile_config = state.compile_config
        elif hasattr(generation_config, "compile_config"):
            del generation_config.compile_config
    _drop_compiled_call(model)  # compiled while patched: it holds HashAttention's attention
    if state.bucketed_static_cache:
        model.__dict__.pop("_prepare_static_cache", None)
    state.static_cache = None


def _drop_compiled_call(model) -> None:
    for name in ("_compiled_call", "_last_compile_config"):
        model.__dict__.pop(name, None)


def _prepare_bucketed_cache(model, state: GenerationState, prepare, bucket: int, cache_implementation: str,
                            batch_size: int, max_cache_len: int, *args, **kwargs):
    """transformers' ``_prepare_static_cache(cache_implementation, batch_size, max_cache_len, ...)`` with the
    length rounded up to the bucket, returning the previous call's cache (reset) when it has that length
    and batch size."""
    length = bucketed_length(max(max_cache_len, getattr(model, "_previous_max_cache_length", -1)), bucket)
    previous = state.static_cache
    if previous is not None and cache_implementation == "static" and _reusable(previous, batch_size, length):
        previous.reset()
        return previous
    state.static_cache = None  # released before the new one is allocated
    cache = prepare(cache_implementation, batch_size, length, *args, **kwargs)
    state.static_cache = cache if cache_implementation == "static" else None
    return cache


def _reusable(cache, batch_size: int, length: int) -> bool:
    """Whether a cache of an earlier call serves one of ``batch_size`` sequences and ``length`` slots."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return False
    return all(getattr(layer, "max_cache_len", None) == length
               and (not layer.is_initialized or layer.batch_size == batch_size) for layer in layers)


def mark_cache(cache, defer_stop_check: bool) -> None:
    """Record on a cache that the patched model using it asked for deferred stop checks.

    Only outside torch.compile: transformers decides after the prompt's forward, which runs eagerly,
    and an attribute set inside a compiled step would be a guard that fails on the next call (a
    recompile of a step compiled over a cache filled by other means)."""
    if is_torchdynamo_compiling():
        return
    if defer_stop_check and not getattr(cache, DEFER_STOP_CHECK_ATTRIBUTE, False):
        setattr(cache, DEFER_STOP_CHECK_ATTRIBUTE, True)


def defers_stop_check(device: torch.device, cache, cache_is_returned: bool, is_assistant: bool) -> bool:
    """Whether transformers may defer the stop check for a HashAttention cache: on CUDA, not for an
    assistant model, and only where the cache can be cropped back one step or is not returned
    (transformers' own condition for deferring)."""
    if torch.device(device).type != "cuda" or is_assistant or cache is None:
        return False
    if not getattr(cache, DEFER_STOP_CHECK_ATTRIBUTE, False):
        return False
    return bool(getattr(cache, "is_croppable", False)) or not cache_is_returned


def install_deferred_stop_check() -> bool:
    """Extend transformers' ``DeferredStopCheck.is_supported`` with :func:`defers_stop_check` (once;
    idempotent). Returns False when this transformers has no deferred stop check (nothing changed)."""
    try:
        from transformers.generation import utils as generation_utils
    except ImportError:
        return False
    deferred = getattr(generation_utils, "DeferredStopCheck", None)
    if deferred is None or not hasattr(deferred, "is_supported"):
        return False
    original = deferred.is_supported
    if getattr(original, "_hashattention", False):
        return True

    def is_supported(device, cache, cache_is_returned, is_assistant=False):
        return original(device, cache, cache_is_returned, is_assistant=is_assistant) or defers_stop_check(
            device, cache, cache_is_returned, is_assistant)

    is_supported._hashattention = True
    deferred.is_supported = staticmethod(is_supported)
    return True

