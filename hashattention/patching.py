"""Enable HashAttention on a Hugging Face Llama / Mistral model in one call, and undo it in one.

    handle = hashattention.patch(model, adapters, HashAttentionConfig(sparsity=16))
    model.generate(...)            # greedy, sampling, batches with left padding, StaticCache
    hashattention.unpatch(model)   # or: with hashattention.patch(...): ...

``patch`` registers the ``"hashattention"`` attention and mask functions with transformers,
switches the model to them (``set_attn_implementation``) and adds one forward pre-hook per
attention module. The hook converts the module's layer of whatever cache it is given into
a signature layer (:mod:`hashattention.cache`) and passes that layer and the module's
adapter to the attention function as keyword arguments. The model's weights, its modules
and its state dict are untouched; ``unpatch`` removes the hooks and restores the previous
attention implementation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional

import torch

from .adapters import HashAdapters
from .attention import ATTENTION_NAME, LayerRuntime, register
from .cache import SIGNATURE_LAYERS, ensure_signature_layer
from .config import HashAttentionConfig, validate_for_model

SUPPORTED_MODEL_TYPES = ("llama", "mistral")
_STATE_ATTRIBUTE = "_hashattention_patch"


@dataclasses.dataclass
class PatchHandle:
    """Returned by :func:`patch`; also a context manager that unpatches on exit."""

    model: torch.nn.Module
    adapters: HashAdapters
    config: HashAttentionConfig
    previous_attn_implementation: str
    hooks: List[torch.utils.hooks.RemovableHandle]

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        if getattr(self.model, _STATE_ATTRIBUTE, None) is self:
            unpatch(self.model)


def decoder_layers(model):
    """The decoder layers of a transformers causal LM or base model (``model.model.layers``)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: could not find the decoder layers (expected model.model.layers)")
    return layers


def _check_model(model, adapters: HashAdapters, config: HashAttentionConfig) -> None:
    model_config = model.config.get_text_config(decoder=True)
    model_type = getattr(model_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"hashattention.patch supports model types {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
    if getattr(model_config, "sliding_window", None) is not None:
        raise ValueError(
            f"hashattention.patch needs full attention, but this {model_type} config has "
            f"sliding_window={model_config.sliding_window}. Models without one (Mistral-7B v0.2 and later) are "
            "supported; if your contexts stay within the window, set model.config.sliding_window = None first"
        )
    heads = model_config.num_attention_heads
    expected = {
        "num_layers": model_config.num_hidden_layers,
        "num_query_heads": heads,
        "num_kv_heads": getattr(model_config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(model_config, "head_dim", None) or model_config.hidden_size // heads,
    }
    for name, value in expected.items():
        if getattr(adapters.config, name) != value:
            raise ValueError(
                f"adapters do not fit this model: adapters.config.{name} = {getattr(adapters.config, name)}, "
                f"the model has {value}"
            )
    if config.bits is not None and config.bits != adapters.config.bits:
        raise ValueError(f"HashAttentionConfig.bits = {config.bits} but the adapters produce {adapters.config.bits} bits")
    validate_for_model(config, model_config.num_hidden_layers)


def _inject_layer_state(runtime: LayerRuntime, module, args, kwargs):
    """Forward pre-hook of an attention module: hand its adapter and signature cache layer to the attention function."""
    cache = kwargs.get("past_key_values")
    layer = start_layer = None
    if cache is not None and not runtime.dense:
        layer = ensure_signature_layer(cache, module.layer_idx, runtime.adapter)
        index = runtime.start_layer_index
        if index is not None and index < len(cache.layers) and isinstance(cache.layers[index], SIGNATURE_LAYERS):
            start_layer = cache.layers[index]
    kwargs["hashattention"] = runtime
    kwargs["hashattention_cache_layer"] = layer
    kwargs["hashattention_start_layer"] = start_layer
    return args, kwargs


def patch(model, adapters: HashAdapters, config: Optional[HashAttentionConfig] = None) -> PatchHandle:
    """Enable HashAttention on ``model`` (a transformers Llama / Mistral causal LM or base model).

    Args:
        model: the model; it keeps working with ``forward`` and ``generate``.
        adapters: :class:`~hashattention.adapters.HashAdapters` shaped for this model; moved to
            the model's device (their dtype is kept: float32 adapters stay float32).
        config: :class:`HashAttentionConfig`; default ``HashAttentionConfig()`` (16x sparsity).

    Returns:
        A :class:`PatchHandle`, usable as a context manager. Patching a patched model
        replaces the previous patch. A cache filled before patching is continued (its keys are
        encoded once, on first use); one filled under other adapters raises ``ValueError``.
    """
    config = HashAttentionConfig() if config is None else config
    if not isinstance(adapters, HashAdapters):
        raise ValueError(f"adapters must be a HashAdapters, got {type(adapters).__name__}")
    if not isinstance(config, HashAttentionConfig):
        raise ValueError(f"config must be a HashAttentionConfig, got {type(config).__name__}")
    _check_model(model, adapters, config)
    if getattr(model, _STATE_ATTRIBUTE, None) is not None:
        unpatch(model)

    register()
    adapters.to(device=model.device)
    model_config = model.config.get_text_config(decoder=True)
    heads = model_config.num_attention_heads
    selection_heads = heads if config.selection == "query_head" else adapters.config.num_kv_heads
    previous = model.config._attn_implementation
    hooks = []
    layers = decoder_layers(model)
    sparse_layers = [index for index in range(len(layers)) if index not in config.dense_layers]
    for index, decoder_layer in enumerate(layers):
        attention = decoder_layer.self_attn
        runtime = LayerRuntime(
            adapter=adapters[index],
            config=config,
            selection_heads=selection_heads,
            dense=index in config.dense_layers,
            start_layer_index=sparse_layers[0] if sparse_layers else None,
            last_sparse_layer=bool(sparse_layers) and index == sparse_layers[-1],
        )
        hook = functools.partial(_inject_layer_state, runtime)
        hooks.append(attention.register_forward_pre_hook(hook, with_kwargs=True))
    model.set_attn_implementation(ATTENTION_NAME)
    handle = PatchHandle(model, adapters, config, previous, hooks)
    setattr(model, _STATE_ATTRIBUTE, handle)
    return handle


def unpatch(model) -> None:
    """Undo :func:`patch`: remove the hooks and restore the previous attention implementation."""
    handle = getattr(model, _STATE_ATTRIBUTE, None)
    if handle is None:
        raise ValueError(f"{type(model).__name__} is not patched with HashAttention")
    for hook in handle.hooks:
        hook.remove()
    model.set_attn_implementation(handle.previous_attn_implementation)
    delattr(model, _STATE_ATTRIBUTE)


def is_patched(model) -> bool:
    return getattr(model, _STATE_ATTRIBUTE, None) is not None
