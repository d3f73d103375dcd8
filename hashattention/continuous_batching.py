"""Start transformers' continuous batching on a patched model with ``"paged|hashattention"``.

A model patched by :func:`hashattention.patch` runs the ``"hashattention"`` attention. When its
continuous batching manager starts (``init_continuous_batching``, which ``generate_batch``,
``continuous_batching_context_manager`` and ``transformers serve --continuous-batching`` call),
transformers switches a non-paged implementation ``X`` to ``"paged|X"`` -- here
``"paged|hashattention"`` (:mod:`hashattention.paged_attention`) -- and back to ``X`` when the
manager stops. Except that, where flash attention is installed, it first switches a model that
supports it to flash attention, which would drop HashAttention without a word.

:func:`install` (called by ``patch``) therefore wraps the model's ``init_continuous_batching``: it
checks the model and the patch again (a config edited after patching, such as a sliding window,
or adapters changed in place), raising ``ValueError`` before any manager exists, and keeps
transformers from choosing flash attention while the manager picks its implementation.
:func:`uninstall` (called by ``unpatch``) removes the wrapper.
"""

from __future__ import annotations

from typing import Callable

from .attention import ATTENTION_NAME
from .paged_attention import PAGED_ATTENTION_NAME

_WRAPPER = "init_continuous_batching"


def install(model, check: Callable[[], None], tensor_parallel: bool) -> None:
    """Wrap ``model.init_continuous_batching`` (an instance attribute; the class is untouched).

    Args:
        model: the patched model.
        check: raises ``ValueError`` when the model no longer fits the patch (``patch``'s checks).
        tensor_parallel: the model is sharded by tensor parallelism (not supported here).
    """
    original = model.init_continuous_batching

    def init_continuous_batching(*args, **kwargs):
        check_ready(model, check, tensor_parallel)
        had_own = "_supports_flash_attn" in model.__dict__
        previous = model.__dict__.get("_supports_flash_attn")
        model._supports_flash_attn = False  # keep "hashattention" -> "paged|hashattention"
        try:
            return original(*args, **kwargs)
        finally:
            if had_own:
                model._supports_flash_attn = previous
            else:
                del model._supports_flash_attn

    init_continuous_batching.__doc__ = original.__doc__
    setattr(model, _WRAPPER, init_continuous_batching)


def uninstall(model) -> None:
    """Remove :func:`install`'s wrapper (the class's method shows again)."""
    model.__dict__.pop(_WRAPPER, None)


def check_ready(model, check: Callable[[], None], tensor_parallel: bool) -> None:
    """ValueError naming what keeps the patched model from continuous batching with HashAttention."""
    if tensor_parallel:
        raise ValueError(
            f"{PAGED_ATTENTION_NAME}: continuous batching on a tensor-parallel model is not supported "
            "(each rank would need its own signature pages); use model.generate"
        )
    implementation = model.config._attn_implementation
    if implementation not in (ATTENTION_NAME, PAGED_ATTENTION_NAME):
        raise ValueError(
            f"the model is patched with HashAttention but its attention implementation is {implementation!r}; "
            f"continuous batching needs {ATTENTION_NAME!r} (as patch sets it) or {PAGED_ATTENTION_NAME!r}"
        )
    check()
