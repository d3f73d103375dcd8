"""The ``"hashattention"`` attention implementation for transformers' ``AttentionInterface``.

transformers calls :func:`hashattention_attention_forward` from every attention layer with
post-RoPE queries ``(B, Hq, L, D)`` and the cached keys/values ``(B, Hkv, N, D)`` (``N`` is
the whole preallocated buffer for a ``StaticCache``). Per forward call the layer's
:class:`KeySelection` (the ``hashattention`` keyword argument) splits the ``L`` query rows:

* the first ``L - P`` rows run dense through transformers' own SDPA path;
* the last ``P`` rows each attend to the keys that :meth:`KeySelection.select` picks for them,
  through :func:`hashattention.ops.sparse_attention`.

That is the one attention path of the package. :class:`LayerRuntime`, what
:func:`hashattention.patch` installs, selects by learned signatures: ``P`` =
``sparse_prompt_tokens`` for a prompt and 1 for a decode step; query signatures -> fused Hamming
top-k against the cache layer's key signatures. A static cache layer defers encoding the keys it
just appended, so the query rows and those keys are encoded in one op call
(``encode_signatures_pair``: one encoder launch per layer and decode step) and the keys'
signatures are written into the cache before the selection reads them
(:meth:`hashattention.cache.SignatureStaticLayer.query_and_key_signatures`). The evaluation
harness plugs its baselines (oracle top-k, H2O, Quest, ...) into the same path with its own
:class:`KeySelection` (:mod:`hashattention.evaluation.attention_hook`).

Valid lengths come from the cache layer (a device tensor for static caches), left-padding
offsets from the boolean mask built by :func:`hashattention_mask` (the first visible key of
the last query row); budgets are computed on the device. Nothing is read back to the host,
so a static-cache decode step can be captured in a CUDA graph.

:mod:`hashattention.patching` passes the per-layer state through three keyword arguments that
a forward pre-hook adds to each attention module's call: ``hashattention`` (a
:class:`LayerRuntime`), ``hashattention_cache_layer`` (the signature cache layer, or None
without a cache) and ``hashattention_start_layer`` (the first sparse layer's cache layer, which
shares the left-padding offsets and budgets; or None). Without them (e.g. a module called
outside a patched model) the function is plain SDPA.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface
from transformers.utils import is_torchdynamo_compiling

from . import ops
from .adapters import LayerAdapter
from .config import HashAttentionConfig
from .padding import first_visible_key

ATTENTION_NAME = "hashattention"


class KeySelection:
    """How one attention layer's sparse query rows choose their keys: what
    :func:`hashattention_attention_forward` asks of its ``hashattention`` keyword argument.

    Shapes: ``query`` ``(B, Hq, P, D)`` (the sparse rows, at positions ``N - P .. N - 1`` of a cache
    without padding), ``key`` / ``value`` ``(B, Hkv, N, D)``; selections are int32 ``(indices
    (B, Hs, P, K), counts (B, Hs, P))`` as :func:`hashattention.ops.hamming_topk` returns them.
    """

    #: Every row of the layer runs dense (SDPA), nothing is selected.
    dense: bool = False
    #: A row's selection depends on the attention of the rows before it (H2O) or on more than its
    #: own query and each key alone (Quest): the sparse rows are then selected and attended one at a
    #: time, each against the keys up to its own position, exactly as token-by-token decoding would.
    #: (Assumes the keys end at the call's last row: a cache without padding.)
    sequential_rows: bool = False

    def sparse_rows(self, rows: int, keys: int) -> int:
        """How many of a call's ``rows`` query rows (the last ones) run sparse; ``keys`` cached keys."""
        raise NotImplementedError

    def select(self, query: Tensor, key: Tensor, value: Tensor, scaling: float, attention_mask: Optional[Tensor],
               cache_layer, start_layer) -> Tuple[Tensor, Tensor]:
        """``(indices, counts)`` of the sparse rows (the arguments are the forward's, see the module docstring)."""
        raise NotImplementedError

    def observe_dense(self, query: Tensor, key: Tensor, scaling: float) -> None:
        """The first ``L - P`` rows ``(B, Hq, L - P, D)`` ran dense against ``key[:, :, :N - P]``."""

    def observe_sparse(self, query: Tensor, key: Tensor, indices: Tensor, counts: Tensor, lse: Tensor,
                       scaling: float) -> None:
        """The sparse rows attended to their selection with log-sum-exp ``lse`` float32 ``(B, Hq, P)``."""


@dataclasses.dataclass(frozen=True)
class LayerRuntime(KeySelection):
    """HashAttention's selection for one patched attention layer: learned signatures, Hamming top-k."""

    adapter: LayerAdapter
    config: HashAttentionConfig
    selection_heads: int
    dense: bool = False
    #: The layer whose cache layer holds each forward's left-padding offsets and budgets (the
    #: model's first sparse layer computes them, later ones read them); None: every call computes
    #: its own.
    start_layer_index: Optional[int] = None
    #: The model's last sparse layer: it ends the forward's use of the shared bounds
    #: (:meth:`hashattention.cache.SharedSelectionBounds.release`).
    last_sparse_layer: bool = False

    def sparse_rows(self, rows: int, keys: int) -> int:
        return rows if rows == 1 else min(self.config.sparse_prompt_tokens, rows)

    def select(self, query, key, value, scaling, attention_mask, cache_layer, start_layer):
        batch = query.shape[0]
        if cache_layer is None:  # no cache (use_cache=False): encode the keys of this call
            query_signatures, key_signatures = self.adapter.decode_signatures(query, key)

            def valid_lengths():
                return torch.full((batch,), key.shape[2], dtype=torch.int32, device=query.device)
        else:

            def valid_lengths():
                return cache_layer.valid_lengths(batch, query.device)
        lengths, start_positions, budgets = selection_bounds(
            self.config, attention_mask, valid_lengths, batch, query.device, cache_layer, start_layer,
            last_layer=self.last_sparse_layer,
        )
        arguments = selection_arguments(self, key.shape[2], lengths, start_positions, budgets)
        if cache_layer is not None:
            # A static cache's decode step: the keys this forward appended are encoded and stored by the
            # selection's own op (one launch where the CUDA kernel can); otherwise they are written here,
            # before the selection reads them.
            select_pending = getattr(cache_layer, "select_with_pending_keys", None)
            selection = select_pending(query, **arguments) if select_pending is not None else None
            if selection is not None:
                return selection
            query_signatures, key_signatures = cache_layer.query_and_key_signatures(query)
        return ops.hamming_topk(query_signatures, key_signatures, **arguments)


def hashattention_mask(*args, **kwargs) -> Optional[Tensor]:
    """The mask function registered for ``"hashattention"``: exactly SDPA's boolean mask.

    The dense rows get the same mask as the unpatched SDPA model; the sparse rows only read
    the left-padding offset from it. (Without a registered mask function transformers would
    pass no mask at all and padding would be lost.)
    """
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register the attention and mask functions under ``"hashattention"`` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, hashattention_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, hashattention_mask)


def start_positions_from_mask(attention_mask: Optional[Tensor], batch_size: int, device) -> Tensor:
    """int32 ``(B,)`` left-padding offsets: the first key the last query row may see.

    ``attention_mask`` is SDPA's boolean ``(B, 1, L, N)`` mask or None (no padding). With left
    padding the last row (a real token) sees ``[start, position]``. A row with no True gives 0.
    The reduction is an op (:mod:`hashattention.padding` says why).
    """
    visible = last_row_visibility(attention_mask)
    if visible is None:
        return torch.zeros(batch_size, dtype=torch.int32, device=device)
    return first_visible_key(visible).expand(batch_size).contiguous()


def last_row_visibility(attention_mask: Optional[Tensor]) -> Optional[Tensor]:
    """Bool ``(B or 1, N)``: the keys the last query row of SDPA's boolean ``(B or 1, 1, L, N)`` mask
    may see (None without a mask)."""
    if attention_mask is None:
        return None
    if attention_mask.dtype != torch.bool:
        raise ValueError(f"hashattention expects a boolean attention mask, got {attention_mask.dtype}")
    return attention_mask[:, 0, -1, :]


def selection_bounds(
    config: HashAttentionConfig,
    attention_mask: Optional[Tensor],
    valid_lengths: Callable[[], Tensor],
    batch_size: int,
    device,
    cache_layer=None,
    start_layer=None,
    last_layer: bool = False,
) -> Tuple[Tensor, Tensor, Tensor]:
    """int32 ``(B,)`` valid lengths, left-padding offsets and heavy-token budgets, once per forward pass.

    ``valid_lengths()`` gives this layer's lengths; it is only called when they are not loaded.
    ``start_layer`` is the signature cache layer of the model's first sparse layer (or None). When
    it is this call's own ``cache_layer``, all three are computed and stored there; later layers
    load them (see :class:`hashattention.cache.SharedSelectionBounds`): every layer of a forward
    has appended the same tokens by its attention. Without a mask (no padding) each layer computes
    its own, except under torch.compile, where one op call serves every layer either way.
    ``last_layer``: this is the model's last sparse layer, after which the forward no longer needs
    the stored bounds.
    """
    # Eagerly the stored bounds are matched to their forward by its mask object, so without a mask
    # each layer computes its own; a compiled forward always shares them (they are its own tensors).
    shared = start_layer is not None and (attention_mask is not None or is_torchdynamo_compiling())
    bounds = None
    if shared and start_layer is not cache_layer:
        bounds = start_layer.selection_bounds.load(attention_mask, batch_size)
        if bounds is not None:
            bounds = tuple(t.to(device) for t in bounds)
    if bounds is None:
        bounds = compute_selection_bounds(config, attention_mask, valid_lengths(), batch_size)
        if shared and start_layer is cache_layer:
            start_layer.selection_bounds.store(*bounds, attention_mask)
    if last_layer and start_layer is not None:
        start_layer.selection_bounds.release()
    return bounds


def compute_selection_bounds(
    config: HashAttentionConfig, attention_mask: Optional[Tensor], lengths: Tensor, batch_size: int
) -> Tuple[Tensor, Tensor, Tensor]:
    """int32 ``(B,)`` lengths, left-padding offsets and budgets from ``lengths`` (integer ``(B,)``) and
    SDPA's boolean ``(B or 1, 1, L, N)`` mask (or None), in one op call (:mod:`hashattention.bounds`
    says why it is an op)."""
    visible = last_row_visibility(attention_mask)
    if visible is not None:
        visible = visible.expand(batch_size, -1)
    return torch.ops.hashattention.selection_bounds(
        lengths, visible, config.sparsity, config.budget_tokens, config.window_tokens, config.dense_below_tokens
    )


def selection_arguments(
    runtime: LayerRuntime, keys: int, lengths: Tensor, start_positions: Tensor, budgets: Optional[Tensor]
) -> dict:
    """:func:`hashattention.ops.hamming_topk`'s keyword arguments after the signatures, for a layer whose
    cache holds ``keys`` slots (``budgets`` None: :meth:`HashAttentionConfig.heavy_tokens` of the valid keys)."""
    config = runtime.config
    if budgets is None:
        budgets = config.heavy_tokens(lengths - start_positions).to(torch.int32)
    return dict(
        selection_heads=runtime.selection_heads,
        sink_tokens=config.sink_tokens,
        local_tokens=config.local_tokens,
        budget_tokens=config.heavy_width(keys),
        lengths=lengths,
        start_positions=start_positions,
        budgets=budgets,
    )


def select_and_attend(
    runtime: LayerRuntime,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_signatures: Tensor,
    lengths: Tensor,
    start_positions: Tensor,
    scaling: float,
    budgets: Optional[Tensor] = None,
) -> Tensor:
    """A decode step's sparse attention from signatures already in a cache, alone (the benchmarks time it).

    Args:
        query: ``(B, Hq, P, D)``, the last ``P`` rows of the chunk.
        key, value: ``(B, Hkv, N, D)`` cache (HF layout, read in place).
        key_signatures: int32 ``(B, Hk, S, W)`` with ``S >= N`` (rows at or beyond ``lengths`` are never
            selected).
        lengths, start_positions: int32 ``(B,)`` on the device.
        budgets: int32 ``(B,)`` heavy tokens per sequence; None: from the valid keys.

    Returns:
        ``(B, Hq, P, D)`` in the query dtype.
    """
    indices, counts = ops.hamming_topk(
        runtime.adapter.query_signatures(query), key_signatures,
        **selection_arguments(runtime, key.shape[2], lengths, start_positions, budgets),
    )
    out, _ = ops.sparse_attention(query, key, value, indices, counts, scale=scaling)
    return out


def _dense_rows(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                sparse_rows: int, dropout: float, scaling: float, kwargs) -> Tensor:
    """SDPA of the first ``L - P`` rows of a call whose last ``P = sparse_rows`` rows run sparse: ``(B, L - P, Hq, D)``."""
    rows = query.shape[2]
    if sparse_rows and attention_mask is None:
        # SDPA skipped the mask: a prefill from position 0 without padding, so the dense rows
        # are positions 0 .. rows - 1 and see only the first rows keys.
        key, value = key[:, :, :rows], value[:, :, :rows]
    elif sparse_rows:
        attention_mask = attention_mask[:, :, :rows]
    out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                    **kwargs)
    return out


def _sparse_rows(selection: KeySelection, query: Tensor, key: Tensor, value: Tensor, scaling: float,
                 attention_mask: Optional[Tensor], cache_layer, start_layer) -> Tensor:
    """Attention of the last ``P`` rows over their selected keys: ``(B, Hq, P, D)``."""
    rows, keys = query.shape[2], key.shape[2]
    if selection.sequential_rows and rows > 1:
        outs = []
        for row in range(rows):
            seen = keys - rows + row + 1
            mask = None if attention_mask is None else attention_mask[:, :, row : row + 1, :seen]
            outs.append(_sparse_rows(selection, query[:, :, row : row + 1], key[:, :, :seen], value[:, :, :seen],
                                     scaling, mask, cache_layer, start_layer))
        return torch.cat(outs, dim=2)
    indices, counts = selection.select(query, key, value, scaling, attention_mask, cache_layer, start_layer)
    workspace_of = getattr(cache_layer, "attention_workspace", None)  # static cache layers only
    workspace = workspace_of(query.shape[0], query.shape[1], rows) if workspace_of is not None else None
    out, lse = ops.sparse_attention(query, key, value, indices, counts, scale=scaling, workspace=workspace)
    selection.observe_sparse(query, key, indices, counts, lse, scaling)
    return out


def hashattention_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
) -> Tuple[Tensor, None]:
    """transformers attention function: returns ``(out (B, L, Hq, D), None)``."""
    selection: Optional[KeySelection] = kwargs.pop("hashattention", None)
    cache_layer = kwargs.pop("hashattention_cache_layer", None)
    start_layer = kwargs.pop("hashattention_start_layer", None)
    if selection is None or selection.dense:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5

    rows, keys = query.shape[2], key.shape[2]
    sparse_rows = selection.sparse_rows(rows, keys)
    dense_rows = rows - sparse_rows
    parts = []
    if dense_rows:
        dense_query = query[:, :, :dense_rows]
        parts.append(_dense_rows(module, dense_query, key, value, attention_mask, sparse_rows, dropout, scaling,
                                 kwargs))
        selection.observe_dense(dense_query, key[:, :, : keys - sparse_rows], scaling)
    if sparse_rows:
        sparse_out = _sparse_rows(selection, query[:, :, dense_rows:], key, value, scaling, attention_mask,
                                  cache_layer, start_layer)
        parts.append(sparse_out.transpose(1, 2))
    elif cache_layer is not None:
        cache_layer.flush_pending_keys()  # keys appended by this forward never outlive it
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out.contiguous(), None
