"""Cache layers that keep packed key signatures next to K/V.

Each key is encoded exactly once and stored as int32 signatures ``(B, Hk, N, W)`` beside the
keys, so a decode step reads ``4 W`` bytes per key and head instead of re-encoding.

* :class:`SignatureDynamicLayer` grows by concatenation, like transformers' ``DynamicLayer``,
  and encodes the new keys in ``update``.
* :class:`SignatureStaticLayer` preallocates ``max_cache_len`` rows, like ``StaticLayer``,
  and writes in place (static addresses, CUDA-graph safe). Its ``update`` only records the
  appended keys as *pending*; the layer's attention forward then encodes them together with
  its query rows in one op call (:meth:`SignatureStaticLayer.query_and_key_signatures`: one
  encoder launch per layer and decode step instead of two) and writes them before the
  selection. Every other read of ``key_signatures`` encodes pending keys first, so readers
  always see every appended key's signatures.

Users do not build these by hand: :func:`hashattention.patch` converts the layers of
whatever cache the model gets (``DynamicCache`` from ``generate``, a user's
``StaticCache``, ...) the first time each attention layer sees it
(:func:`ensure_signature_layer`).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer
from transformers.utils import is_torchdynamo_compiling

from .adapters import LayerAdapter


def aligned_signature_buffer(batch: int, heads: int, slots: int, words: int, device) -> Tensor:
    """Zeros, int32 ``(B, H, S, W)``, contiguous, with ``S`` = ``slots`` rounded up to a multiple of 4.

    With one-word signatures every head's row then starts 16-byte aligned, so the CUDA
    ``hamming_topk`` reads four signatures per 16-byte load and takes its one-launch path (a
    ``max_cache_len`` of ``n + steps`` is rarely a multiple of 4; unpadded, the selection fell back
    to scalar loads and two launches: H200, 128K decode). The extra slots stay beyond every
    valid length, so they are never selected.

    The buffer is contiguous on purpose, not a ``[:, :, :slots]`` view of a padded one: under
    ``torch.compile`` the cache update (``index_copy_``) followed by the custom op made inductor
    copy a view into a fresh contiguous tensor before every ``hamming_topk`` call, the whole
    signature cache of a layer per decode step (H200, Llama-3.1-8B shape, 128K, B = 4: ~1 ms per
    step), which also lost the alignment.
    """
    padded = -(-slots // 4) * 4
    return torch.zeros((batch, heads, padded, words), dtype=torch.int32, device=device)


def aligned_copy(signatures: Tensor) -> Tensor:
    """``signatures`` ``(B, H, N, W)`` copied into the first ``N`` slots of an :func:`aligned_signature_buffer`."""
    batch, heads, slots, words = signatures.shape
    buffer = aligned_signature_buffer(batch, heads, slots, words, signatures.device)
    buffer[:, :, :slots].copy_(signatures)
    return buffer


class SharedSelectionBounds:
    """Each forward pass's valid lengths, left-padding offsets and heavy-token budgets, computed
    once for all layers.

    Every attention layer of a forward pass gets the same boolean mask and the same number of
    valid keys. Reducing the mask to the ``(B,)`` offsets is a pass over ``B x N`` entries (H200,
    128K, B = 4: ~11 us per layer, 0.36 ms per decode step when each layer did it), and even the
    lengths and budgets alone were one small kernel per layer in a compiled step (each layer
    reads its own length counter: 48 launches, 53 us per step at B = 4 / 128K). The first sparse
    layer of each forward computes all three and :meth:`store` s them here (on its own cache
    layer); later layers :meth:`load` them.

    ``lengths``, ``start_positions`` and ``budgets`` are int32 ``(B,)`` device tensors. A static cache
    preallocates them, so a store is an in-place copy into fixed addresses (CUDA-graph safe); a
    dynamic cache keeps the tensors. ``mask`` remembers, outside torch.compile, which mask they
    came from, so that a layer called on its own with another mask recomputes instead of reading
    stale values. (A compiled forward runs the layers in order, so it reads without that check.)

    Under torch.compile later layers read the traced tensors themselves (``traced``, the outputs of
    one :func:`hashattention.bounds.selection_bounds` op call) and the buffers are not written: no
    eager reader could use them (the mask check), and a buffer read back in the graph that copied
    into it is, to inductor, the copied expression again. The model's last sparse layer
    :meth:`release` s the traced tensors, so none outlives the graph (it would become a graph output
    that a CUDA graph overwrites on its next replay).
    """

    def __init__(self):
        self.lengths: Optional[Tensor] = None
        self.start_positions: Optional[Tensor] = None
        self.budgets: Optional[Tensor] = None
        self.mask: Optional[Tensor] = None
        self.traced: Optional[Tuple[Tensor, Tensor, Tensor]] = None

    def allocate(self, batch_size: int, device) -> None:
        self.lengths = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.start_positions = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.budgets = torch.zeros(batch_size, dtype=torch.int32, device=device)
        if not is_torchdynamo_compiling():
            for buffer in (self.lengths, self.start_positions, self.budgets):
                torch._dynamo.mark_static_address(buffer)

    def store(self, lengths: Tensor, start_positions: Tensor, budgets: Tensor, mask: Tensor) -> None:
        if is_torchdynamo_compiling():  # later layers of the graph read these; nothing outside it does
            self.traced = (lengths, start_positions, budgets)
            return
        if self.start_positions is not None and self.start_positions.shape == start_positions.shape:
            self.lengths.copy_(lengths)
            self.start_positions.copy_(start_positions)
            self.budgets.copy_(budgets)
        else:
            self.lengths, self.start_positions, self.budgets = lengths, start_positions, budgets
        self.mask = mask

    def load(self, mask: Tensor, batch_size: int) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
        """``(lengths, start_positions, budgets)`` if they belong to ``mask`` (always assumed under
        torch.compile), else None."""
        if is_torchdynamo_compiling():
            if self.traced is None or self.traced[1].shape[0] != batch_size:
                return None
            return self.traced
        if self.start_positions is None or self.start_positions.shape[0] != batch_size:
            return None
        if self.mask is not mask:
            return None
        return self.lengths, self.start_positions, self.budgets

    def release(self) -> None:
        """Drop the traced bounds at the end of a compiled forward (no-op outside torch.compile)."""
        self.traced = None


class SignatureDynamicLayer(DynamicLayer):
    """A ``DynamicLayer`` plus ``key_signatures``: int32 ``(B, Hk, N, W)``, one row per cached key."""

    def __init__(self, adapter: LayerAdapter, **kwargs):
        super().__init__()
        self.adapter = adapter
        self.key_signatures: Optional[Tensor] = None
        self.selection_bounds = SharedSelectionBounds()

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> Tuple[Tensor, Tensor]:
        keys, values = super().update(key_states, value_states)
        new_signatures = self.adapter.key_signatures(key_states)
        if self.key_signatures is None:
            self.key_signatures = new_signatures
        else:
            self.key_signatures = torch.cat([self.key_signatures, new_signatures], dim=-2)
        return keys, values

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.key_signatures is not None:
            self.key_signatures = self.key_signatures[:, :, : self.get_seq_length()]

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.key_signatures is not None:
            self.key_signatures = self.key_signatures.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: Tensor) -> None:
        super().batch_select_indices(indices)
        if self.key_signatures is not None:
            self.key_signatures = self.key_signatures[indices, ...]

    def reorder_cache(self, beam_idx: Tensor) -> None:
        super().reorder_cache(beam_idx)
        if self.key_signatures is not None:
            self.key_signatures = self.key_signatures.index_select(0, beam_idx.to(self.key_signatures.device))

    def reset(self) -> None:
        super().reset()
        if self.key_signatures is not None:
            self.key_signatures.zero_()

    def offload(self):
        super().offload()
        if self.key_signatures is not None:
            self.key_signatures = self.key_signatures.to("cpu", non_blocking=True)

    def prefetch(self):
        super().prefetch()
        if self.key_signatures is not None and self.key_signatures.device != self.device:
            self.key_signatures = self.key_signatures.to(self.device, non_blocking=True)

    def valid_lengths(self, batch_size: int, device) -> Tensor:
        """int32 ``(B,)`` number of cached positions (left padding included)."""
        return torch.full((batch_size,), self.get_seq_length(), dtype=torch.int32, device=device)

    def query_and_key_signatures(self, query: Tensor) -> Tuple[Tensor, Tensor]:
        """``(query_signatures (B, Hq, L, W), key_signatures (B, Hk, N, W))`` for an attention
        forward; the keys were encoded in :meth:`update`, so only ``query`` is encoded here."""
        return self.adapter.query_signatures(query), self.key_signatures

    def flush_pending_keys(self) -> None:
        """Nothing to do: this layer encodes keys in :meth:`update` (see :class:`SignatureStaticLayer`)."""


#: Query rows per attention call that a static layer's attention workspace covers: a decode step's
#: one row, and up to HashAttentionConfig.sparse_prompt_tokens (default 128) rows of a prompt chunk.
ATTENTION_WORKSPACE_ROWS = 128


def needs_attention_workspace(device) -> bool:
    """Whether sparse_attention on ``device`` uses a workspace (the CUDA kernel's split counters)."""
    return torch.device(device).type == "cuda"


def attention_workspace_buffer(batch_size: int, query_heads: int, device) -> Optional[Tensor]:
    """Zeroed int32 split counters for :func:`hashattention.ops.sparse_attention` on CUDA (None elsewhere).

    With them the CUDA attention skips a memset per call and starts while the selection before it
    finishes; each call leaves them zero. A fixed address, like the K/V buffers, for CUDA graphs.
    """
    if not needs_attention_workspace(device):
        return None
    buffer = torch.zeros(batch_size * query_heads * ATTENTION_WORKSPACE_ROWS, dtype=torch.int32, device=device)
    if not is_torchdynamo_compiling():
        torch._dynamo.mark_static_address(buffer)
    return buffer


class SignatureStaticLayer(StaticLayer):
    """A ``StaticLayer`` plus a preallocated ``key_signatures`` buffer ``(B, Hk, S, W)``.

    ``S`` is ``max_cache_len`` rounded up to a multiple of 4 (see :func:`aligned_signature_buffer`);
    row ``i < max_cache_len`` holds the signatures of cache slot ``i``.

    :meth:`update` stores K/V at once but defers encoding the appended keys: it keeps them and
    their slots as pending, and the attention forward of the same layer encodes them together
    with its query rows in one op call (:meth:`query_and_key_signatures`; a decode step's two
    encoder launches per layer become one), writing them into the buffer before the selection.
    Everything else sees a complete buffer: the :attr:`key_signatures` property, ``update``,
    ``reorder_cache`` and ``offload`` encode pending keys first (:meth:`flush_pending_keys`),
    and ``reset`` drops them. A forward that runs no sparse rows flushes them too, so pending
    keys never outlive the forward that appended them (under torch.compile they stay inside
    one graph; no tensor escapes into a CUDA graph's outputs).
    """

    def __init__(self, max_cache_len: int, adapter: LayerAdapter, **kwargs):
        super().__init__(max_cache_len=max_cache_len)
        self.adapter = adapter
        self._key_signatures: Optional[Tensor] = None
        # Keys appended by the last update but not yet encoded: (B, Hkv, L, D) and their slots (L,).
        self._pending_keys: Optional[Tensor] = None
        self._pending_positions: Optional[Tensor] = None
        self.selection_bounds = SharedSelectionBounds()
        self._attention_workspace: Optional[Tensor] = None

    @property
    def key_signatures(self) -> Optional[Tensor]:
        """int32 ``(B, Hk, S, W)`` with every appended key's signatures (pending keys are encoded first)."""
        self.flush_pending_keys()
        return self._key_signatures

    @key_signatures.setter
    def key_signatures(self, buffer: Optional[Tensor]) -> None:
        # A buffer set from outside (a converted cache, a benchmark's pre-filled one) is taken as
        # complete: keys still pending belong to the buffer it replaces.
        self._drop_pending_keys()
        self._key_signatures = buffer

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        config = self.adapter.config
        self._key_signatures = aligned_signature_buffer(
            self.batch_size, config.num_key_signature_heads, self.max_cache_len, config.words, self.device
        )
        self.allocate_decode_buffers(self.batch_size, self.device)
        # Same reason as the K/V buffers: a fixed address keeps CUDA graphs valid across steps.
        if not is_torchdynamo_compiling():
            torch._dynamo.mark_static_address(self._key_signatures)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> Tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.flush_pending_keys()  # an earlier chunk that no attention forward consumed
        # Slots before StaticLayer.update advances cumulative_length (device tensor: no host sync).
        self._pending_positions = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
        self._pending_keys = key_states
        return super().update(key_states, value_states)

    def allocate_decode_buffers(self, batch_size: int, device) -> None:
        """The layer's small fixed-address buffers besides K/V and signatures: the shared selection
        bounds and the attention workspace (what ``lazy_initialization`` allocates after them; a
        caller that builds an initialized layer by hand must call this too)."""
        self.selection_bounds.allocate(batch_size, device)
        self._attention_workspace = attention_workspace_buffer(batch_size, self.adapter.config.num_query_heads, device)

    def attention_workspace(self, batch: int, query_heads: int, rows: int) -> Optional[Tensor]:
        """The layer's zeroed sparse-attention counters when they cover ``batch * query_heads * rows``, else None."""
        workspace = self._attention_workspace
        if workspace is None or batch * query_heads * rows > workspace.numel():
            return None
        return workspace

    def query_and_key_signatures(self, query: Tensor) -> Tuple[Tensor, Tensor]:
        """Encode ``query`` and the pending keys in one op call; write the keys' signatures.

        Args:
            query: post-RoPE query rows ``(B, Hq, L, D)`` of the attention forward.

        Returns:
            ``(query_signatures, key_signatures)``: int32 ``(B, Hq, L, W)`` and the buffer
            int32 ``(B, Hk, S, W)``, complete (the pending keys' rows written in place).
        """
        if self._pending_keys is None:
            return self.adapter.query_signatures(query), self._key_signatures
        # The encoder stores the keys' signatures itself (no separate copy kernel per layer).
        query_signatures = self.adapter.decode_signatures_into(
            query, self._pending_keys, self._key_signatures, self._pending_positions
        )
        self._drop_pending_keys()
        return query_signatures, self._key_signatures

    def select_with_pending_keys(self, query: Tensor, **selection) -> Optional[Tuple[Tensor, Tensor]]:
        """The selection of ``query`` with the pending keys' signatures encoded and written by the same op
        (:meth:`LayerAdapter.select_with_new_keys`); None when no keys are pending.

        Args:
            query: post-RoPE query rows ``(B, Hq, L, D)`` of the attention forward.
            selection: :func:`hashattention.ops.hamming_topk`'s keyword arguments after the signatures.

        Returns:
            ``(indices, counts)`` over the complete signature buffer, or None.
        """
        if self._pending_keys is None:
            return None
        selected = self.adapter.select_with_new_keys(
            query, self._pending_keys, self._key_signatures, self._pending_positions, **selection
        )
        self._drop_pending_keys()
        return selected

    def flush_pending_keys(self) -> None:
        """Encode pending keys (the single-stack encoder) and write them into the buffer."""
        if self._pending_keys is not None:
            self._write_pending(self.adapter.key_signatures(self._pending_keys))

    def _write_pending(self, signatures: Tensor) -> None:
        # In place at the pending slots (device positions: CUDA-graph safe, no host sync).
        self._key_signatures.index_copy_(2, self._pending_positions, signatures)
        self._drop_pending_keys()

    def _drop_pending_keys(self) -> None:
        self._pending_keys = None
        self._pending_positions = None

    def reset(self) -> None:
        super().reset()
        self._drop_pending_keys()  # their K/V rows were just cleared too
        if self._key_signatures is not None:
            self._key_signatures.zero_()

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self.flush_pending_keys()  # pending keys are in the old batch order
        super().reorder_cache(beam_idx)
        if self._key_signatures is not None and self.get_seq_length() > 0:
            # index_select keeps the padded, contiguous layout.
            self._key_signatures = self._key_signatures.index_select(0, beam_idx.to(self._key_signatures.device))

    def offload(self):
        self.flush_pending_keys()  # the pending keys live on the device
        super().offload()

    def valid_lengths(self, batch_size: int, device) -> Tensor:
        """int32 ``(B,)`` number of written positions, read on the device (CUDA-graph safe)."""
        return self.cumulative_length.to(device=device, dtype=torch.int32).reshape(1).repeat(batch_size)


SIGNATURE_LAYERS = (SignatureDynamicLayer, SignatureStaticLayer)


def to_signature_layer(layer, adapter: LayerAdapter):
    """A signature layer holding ``layer``'s contents; keys already cached are encoded now, once."""
    if isinstance(layer, SIGNATURE_LAYERS):
        if layer.adapter is not adapter:
            raise ValueError(
                "this cache was filled with other HashAttention adapters; start from a fresh cache after patching"
            )
        return layer
    if type(layer) is DynamicLayer:
        converted = SignatureDynamicLayer(adapter)
        if layer.is_initialized:
            converted.dtype, converted.device = layer.dtype, layer.device
            converted.keys, converted.values, converted.is_initialized = layer.keys, layer.values, True
            if layer.get_seq_length() > 0:
                converted.key_signatures = adapter.key_signatures(layer.keys)
        return converted
    if type(layer) is StaticLayer:
        converted = SignatureStaticLayer(layer.max_cache_len, adapter)
        if layer.is_initialized:
            for name in ("dtype", "device", "batch_size", "num_heads", "k_head_dim", "v_head_dim"):
                setattr(converted, name, getattr(layer, name))
            converted.keys, converted.values = layer.keys, layer.values
            converted.cumulative_length = layer.cumulative_length
            # Unwritten rows get meaningless signatures; they lie beyond the valid length and are never read.
            converted.key_signatures = aligned_copy(adapter.key_signatures(layer.keys))
            converted.allocate_decode_buffers(layer.batch_size, layer.device)
            if not is_torchdynamo_compiling():
                torch._dynamo.mark_static_address(converted.key_signatures)
            converted.is_initialized = True
        return converted
    raise ValueError(
        f"HashAttention supports DynamicLayer and StaticLayer cache layers (full attention), got {type(layer).__name__}"
    )


def ensure_signature_layer(cache: Cache, layer_idx: int, adapter: LayerAdapter):
    """Make ``cache.layers[layer_idx]`` a signature layer (in place) and return it."""
    if cache.layer_class_to_replicate is not None:
        while len(cache.layers) <= layer_idx:  # what Cache.update would do lazily
            cache.layers.append(cache.layer_class_to_replicate())
    if layer_idx >= len(cache.layers):
        raise ValueError(f"the cache has {len(cache.layers)} layers, attention layer {layer_idx} has none")
    layer = cache.layers[layer_idx]
    if not isinstance(layer, SIGNATURE_LAYERS):
        layer = to_signature_layer(layer, adapter)
        cache.layers[layer_idx] = layer
    elif layer.adapter is not adapter:
        to_signature_layer(layer, adapter)  # raises
    return layer
