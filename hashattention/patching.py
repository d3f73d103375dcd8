"""Enable HashAttention on a Hugging Face Llama / Mistral model in one call, and undo it in one.

    handle = hashattention.patch(model, adapters, HashAttentionConfig(sparsity=16))
    model.generate(...)            # greedy, sampling, batches with left padding, StaticCache
    hashattention.unpatch(model)   # or: with hashattention.patch(...): ...

A model carries at most one patch: patching a patched model raises ``ValueError`` (unpatch first),
so after ``unpatch`` or the end of a ``with`` block the model is always exactly as before.

``patch`` registers the ``"hashattention"`` attention and mask functions with transformers,
switches the model to them (``set_attn_implementation``) and adds one forward pre-hook per
attention module. The hook converts the module's layer of whatever cache it is given into
a signature layer (:mod:`hashattention.cache`) and passes that layer and the module's
adapter to the attention function as keyword arguments. The model's weights, its modules
and its state dict are untouched; ``unpatch`` removes the hooks and restores the previous
attention implementation.

It also sets up ``model.generate`` for speed (:mod:`hashattention.generation`: the decode step's
compile settings, static caches in size buckets, stop checks that never wait for the GPU) and
``unpatch`` restores the model's generation settings.

It also registers ``"paged|hashattention"`` (:mod:`hashattention.paged_attention`), which
transformers' continuous batching (``generate_batch``, ``transformers serve``) switches the model
to; ``init_continuous_batching`` checks the patch first (:mod:`hashattention.continuous_batching`).

On a model sharded by transformers' tensor parallelism (``tp_plan="auto"`` under torchrun) each
process computes some of the heads; it runs the adapters of those heads
(:mod:`hashattention.tensor_parallel`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional

import torch

from .adapters import HashAdapters
from .attention import ATTENTION_NAME, LayerRuntime, register
from . import continuous_batching, paged_attention
from .cache import SIGNATURE_LAYERS, ensure_signature_layer
from .config import HashAttentionConfig, validate_for_model
from .generation import GenerationOptions, GenerationState
from . import generation
from .ops import SUPPORTED_HEAD_DIMS
from .tensor_parallel import HeadShard, adapters_for_shard, expected_adapter_heads, head_shard

SUPPORTED_MODEL_TYPES = ("llama", "mistral")
#: Model dtypes the attention and encoder kernels take.
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Adapter parameter dtypes: the kernels' and float64 (passed to the encoder as float32).
ADAPTER_DTYPES = (*SUPPORTED_DTYPES, torch.float64)
_STATE_ATTRIBUTE = "_hashattention_patch"


@dataclasses.dataclass
class PatchHandle:
    """Returned by :func:`patch`; also a context manager that unpatches on exit.

    ``adapters`` are the adapters the layers run: under tensor parallelism this rank's slice
    (``shard`` says which heads), otherwise the ones given to :func:`patch`.
    """

    model: torch.nn.Module
    adapters: HashAdapters
    config: HashAttentionConfig
    previous_attn_implementation: str
    hooks: List[torch.utils.hooks.RemovableHandle]
    shard: Optional[HeadShard] = None
    generation_options: GenerationOptions = dataclasses.field(default_factory=GenerationOptions)
    generation_state: Optional[GenerationState] = None

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        if getattr(self.model, _STATE_ATTRIBUTE, None) is self:  # not already undone by unpatch(model)
            unpatch(self.model)


def decoder_layers(model):
    """The decoder layers of a transformers causal LM or base model (``model.model.layers``)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: could not find the decoder layers (expected model.model.layers)")
    return layers


def _check_model(model, adapters: HashAdapters, config: HashAttentionConfig) -> Optional[HeadShard]:
    """Every check of :func:`patch`, before it changes anything: a ValueError naming what differs.
    Returns the heads this process computes under tensor parallelism (None: all of them)."""
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
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"hashattention.patch: the model's head_dim is {head_dim}; the sparse attention kernels support "
            f"{SUPPORTED_HEAD_DIMS}"
        )
    if model.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"hashattention.patch: the model's dtype is {model.dtype}; the kernels support "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)} (convert it, e.g. model.float())"
        )
    expected = {
        "num_layers": model_config.num_hidden_layers,
        "num_query_heads": heads,
        "num_kv_heads": getattr(model_config, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
    }
    shard = head_shard([getattr(layer, "self_attn", None) for layer in decoder_layers(model)], heads,
                       expected["num_kv_heads"])
    if shard is not None:  # the full adapters or this rank's slice
        expected["num_query_heads"], expected["num_kv_heads"] = expected_adapter_heads(adapters.config, shard)
    for name, value in expected.items():
        if getattr(adapters.config, name) != value:
            raise ValueError(
                f"adapters do not fit this model: adapters.config.{name} = {getattr(adapters.config, name)}, "
                f"the model has {value}"
            )
    _check_adapter_tensors(adapters)
    if config.bits is not None and config.bits != adapters.config.bits:
        raise ValueError(f"HashAttentionConfig.bits = {config.bits} but the adapters produce {adapters.config.bits} bits")
    validate_for_model(config, model_config.num_hidden_layers)
    layers = decoder_layers(model)
    if len(layers) != model_config.num_hidden_layers:
        raise ValueError(
            f"{type(model).__name__} has {len(layers)} decoder layers but its config says num_hidden_layers = "
            f"{model_config.num_hidden_layers}"
        )
    for index, layer in enumerate(layers):
        if getattr(getattr(layer, "self_attn", None), "layer_idx", None) != index:
            raise ValueError(f"decoder layer {index} has no self_attn module with layer_idx = {index}")
    return shard


def _check_adapter_tensors(adapters: HashAdapters) -> None:
    """The adapters' weights have the shapes and dtypes their config promises (a config edited after
    construction, or weights swapped in by hand, would otherwise fail at the first forward)."""
    config = adapters.config
    if len(adapters.layers) != config.num_layers:
        raise ValueError(f"adapters hold {len(adapters.layers)} layers, adapters.config.num_layers = {config.num_layers}")
    sizes = [config.head_dim, *config.hidden_features, config.bits]
    for index, layer in enumerate(adapters.layers):
        for side, stack, heads in (("query", layer.query, config.num_query_heads),
                                   ("key", layer.key, config.num_key_signature_heads)):
            shapes = [tuple(w.shape) for w in stack.weights]
            want = [(heads, fan_in, fan_out) for fan_in, fan_out in zip(sizes[:-1], sizes[1:])]
            if shapes != want:
                key_heads = f", key_heads = {config.key_heads!r}" if side == "key" else ""
                raise ValueError(
                    f"adapters layer {index} {side} weights have shapes {shapes}; adapters.config "
                    f"(heads {heads}{key_heads}, head_dim {config.head_dim}, hidden_features "
                    f"{list(config.hidden_features)}, bits {config.bits}) gives {want}"
                )
            for tensor in [*stack.weights, *stack.biases]:
                if tensor.dtype not in ADAPTER_DTYPES:
                    raise ValueError(
                        f"adapters layer {index} {side} parameters are {tensor.dtype}; supported: "
                        f"{', '.join(str(d) for d in ADAPTER_DTYPES)}"
                    )


def _inject_layer_state(runtime: LayerRuntime, defer_stop_check: bool, module, args, kwargs):
    """Forward pre-hook of an attention module: hand its adapter and signature cache layer to the attention function."""
    cache = kwargs.get("past_key_values")
    layer = start_layer = None
    if cache is not None and not runtime.dense:
        generation.mark_cache(cache, defer_stop_check)
        layer = ensure_signature_layer(cache, module.layer_idx, runtime.adapter)
        index = runtime.start_layer_index
        if index is not None and index < len(cache.layers) and isinstance(cache.layers[index], SIGNATURE_LAYERS):
            start_layer = cache.layers[index]
    kwargs["hashattention"] = runtime
    kwargs["hashattention_cache_layer"] = layer
    kwargs["hashattention_start_layer"] = start_layer
    return args, kwargs


def patch(model, adapters: HashAdapters, config: Optional[HashAttentionConfig] = None,
          generation_options: Optional[GenerationOptions] = None) -> PatchHandle:
    """Enable HashAttention on ``model`` (a transformers Llama / Mistral causal LM or base model).

    Args:
        model: the model (float32, float16 or bfloat16; head dim 64, 128 or 256); it keeps working
            with ``forward`` and ``generate``.
        adapters: :class:`~hashattention.adapters.HashAdapters` shaped for this model; moved to
            the model's device (their dtype is kept: float32 adapters stay float32). On a
            tensor-parallel model (``tp_plan="auto"`` under torchrun) each rank runs the adapters
            of its own heads: pass the full adapters (each rank slices them) or the rank's slice
            (:mod:`hashattention.tensor_parallel`).
        config: :class:`HashAttentionConfig`; default ``HashAttentionConfig()`` (16x sparsity).
        generation_options: how ``model.generate`` runs while patched
            (:class:`~hashattention.generation.GenerationOptions`; default: the decode step's compile
            settings, static caches sized in buckets of 4096 tokens, stop checks that never wait for
            the GPU). Generated tokens do not depend on them.

    Returns:
        A :class:`PatchHandle`, usable as a context manager. A cache filled before patching is
        continued (its keys are encoded once, on first use); one filled under other adapters
        raises ``ValueError``.

    Raises:
        ValueError: before anything is changed, naming what does not fit: the model type, its
            head dim or dtype, the adapters' layout against the model's, ``config.bits`` or
            ``config.dense_layers``, head counts that the tensor-parallel size does not divide; or
            when the model is already patched. Patches do not stack:
            to change the adapters or the config, ``unpatch`` (or leave the ``with`` block) first,
            so that ``unpatch`` and every ``with`` exit return the model to exactly its state before.
    """
    config = HashAttentionConfig() if config is None else config
    if not isinstance(adapters, HashAdapters):
        raise ValueError(f"adapters must be a HashAdapters, got {type(adapters).__name__}")
    if not isinstance(config, HashAttentionConfig):
        raise ValueError(f"config must be a HashAttentionConfig, got {type(config).__name__}")
    generation_options = GenerationOptions() if generation_options is None else generation_options
    if not isinstance(generation_options, GenerationOptions):
        raise ValueError(f"generation_options must be a GenerationOptions, got {type(generation_options).__name__}")
    if is_patched(model):
        raise ValueError(
            f"this {type(model).__name__} is already patched with HashAttention; unpatch first "
            "(hashattention.unpatch(model), or leave the `with hashattention.patch(...)` block), then patch "
            "with the new adapters or config"
        )
    shard = _check_model(model, adapters, config)
    recheck = functools.partial(_check_model, model, adapters, config)  # at continuous batching's start

    if shard is not None:  # each rank runs the adapters of its own heads
        adapters = adapters_for_shard(adapters, shard)

    register()
    paged_attention.register()
    adapters.to(device=model.device)
    local = adapters.config  # the heads this process computes (all of them without tensor parallelism)
    selection_heads = local.num_query_heads if config.selection == "query_head" else local.num_kv_heads
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
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
        hook = functools.partial(_inject_layer_state, runtime, generation_options.defer_stop_check)
        hooks.append(attention.register_forward_pre_hook(hook, with_kwargs=True))
    handle = PatchHandle(model, adapters, config, previous, hooks, shard, generation_options,
                         generation.apply(model, generation_options))
    continuous_batching.install(model, recheck, tensor_parallel=shard is not None)
    setattr(model, _STATE_ATTRIBUTE, handle)
    return handle


def unpatch(model) -> None:
    """Undo :func:`patch`: remove the hooks and restore the previous attention implementation."""
    handle = getattr(model, _STATE_ATTRIBUTE, None)
    if handle is None:
        raise ValueError(f"{type(model).__name__} is not patched with HashAttention")
    for hook in handle.hooks:
        hook.remove()
    continuous_batching.uninstall(model)
    model.set_attn_implementation(handle.previous_attn_implementation)
    if handle.generation_state is not None:
        generation.restore(model, handle.generation_state)
    delattr(model, _STATE_ATTRIBUTE)


def is_patched(model) -> bool:
    return getattr(model, _STATE_ATTRIBUTE, None) is not None
