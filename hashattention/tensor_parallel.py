"""Which attention heads, adapters and signatures a tensor-parallel rank owns.

transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")`` under ``torchrun``)
shards ``q_proj``, ``k_proj`` and ``v_proj`` of every Llama / Mistral attention layer by output
features ("colwise": a ``DTensor`` placed ``Shard(0)`` on a one-dimensional mesh) and ``o_proj`` by
input features ("rowwise", whose output is all-reduced). Rank ``r`` of ``W`` therefore computes
the contiguous query heads ``[r * Hq / W, (r + 1) * Hq / W)`` and KV heads ``[r * Hkv / W,
(r + 1) * Hkv / W)``; its attention function sees queries ``(B, Hq / W, L, D)`` and a KV cache
``(B, Hkv / W, N, D)``. Query head ``h`` still reads KV head ``h // (Hq / Hkv)``, so every KV group
lies on one rank.

HashAttention follows the same split: each rank encodes, caches and selects for its own heads
only, with its slice of the adapters (:func:`shard_adapters`), and nothing crosses ranks for the
selection (a query row's selection depends on its own head's, or KV group's, signatures alone).
The key-signature heads follow the adapters' ``key_heads``: one per query head (``"query"``:
the query-head range) or one per KV head (``"kv"``: the KV-head range).

:func:`head_shard` reads the layout from the model's projection weights; :func:`adapters_for_shard`
turns the adapters a user passes (the full set, as for one process, or a rank's slice) into the
rank's slice. Both raise ``ValueError`` on what cannot work, before :func:`hashattention.patch`
changes anything.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional, Tuple

import torch

from .adapters import AdapterConfig, HashAdapters

#: The projections whose output features are the attention heads.
HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """The attention heads rank ``rank`` of a ``world_size``-way tensor-parallel model computes.

    ``num_query_heads`` and ``num_kv_heads`` are the whole model's (its config's); each divides by
    ``world_size``. Head ranges are contiguous, as ``Shard(0)`` of the projection weights places them.
    """

    rank: int
    world_size: int
    num_query_heads: int
    num_kv_heads: int

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"HeadShard.rank must be in [0, {self.world_size}), got {self.rank}")
        check_divisible(self.num_query_heads, self.num_kv_heads, self.world_size)

    @property
    def local_query_heads(self) -> int:
        return self.num_query_heads // self.world_size

    @property
    def local_kv_heads(self) -> int:
        return self.num_kv_heads // self.world_size

    @property
    def query_heads(self) -> range:
        """This rank's query heads, e.g. ``range(16, 32)`` for rank 1 of 2 with 32 query heads."""
        return range(self.rank * self.local_query_heads, (self.rank + 1) * self.local_query_heads)

    @property
    def kv_heads(self) -> range:
        """This rank's KV heads (the KV heads of its query heads)."""
        return range(self.rank * self.local_kv_heads, (self.rank + 1) * self.local_kv_heads)

    def key_signature_heads(self, key_heads: str) -> range:
        """This rank's key-signature heads for adapters with ``key_heads`` ``"query"`` or ``"kv"``."""
        return self.query_heads if key_heads == "query" else self.kv_heads

    def describe(self) -> str:
        return (f"tensor-parallel rank {self.rank} of {self.world_size}: query heads "
                f"[{self.query_heads.start}, {self.query_heads.stop}), KV heads "
                f"[{self.kv_heads.start}, {self.kv_heads.stop})")


def check_divisible(num_query_heads: int, num_kv_heads: int, world_size: int) -> None:
    """ValueError unless the tensor-parallel size ``world_size`` divides both head counts (a head split
    across ranks would have no whole query, key or signature on either)."""
    for name, heads in (("num_attention_heads", num_query_heads), ("num_key_value_heads", num_kv_heads)):
        if heads % world_size:
            raise ValueError(
                f"hashattention.patch with tensor parallelism needs the model's {name} ({heads}) to be divisible "
                f"by the tensor-parallel size ({world_size}): each rank must compute whole heads"
            )


def _dtensor_class():
    """``DTensor``, or None when nothing has imported it (then no weight can be one, and a plain
    single-process ``patch`` does not pay for the import)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def head_shard(attention_modules, num_query_heads: int, num_kv_heads: int) -> Optional[HeadShard]:
    """The heads this process computes, read from the attention modules' projection weights.

    Args:
        attention_modules: every decoder layer's ``self_attn`` module (with ``q_proj``, ``k_proj``,
            ``v_proj`` linear layers).
        num_query_heads, num_kv_heads: the model config's head counts.

    Returns:
        None when the projections are plain tensors, replicated ``DTensor`` s or on a mesh of one
        process (no tensor parallelism, or a plan that does not shard attention): every head is
        computed here. Otherwise the :class:`HeadShard` of this process's coordinate on the
        projections' mesh.

    Raises:
        ValueError: the head counts do not divide by the mesh size; the projections are sharded
            other than by output features (``Shard(0)``) on a one-dimensional mesh; or the layers
            disagree (some sharded, some not, or on different meshes).
    """
    dtensor = _dtensor_class()
    layouts = set()
    for index, attention in enumerate(attention_modules):
        for name in HEAD_PROJECTIONS:
            weight = getattr(getattr(attention, name, None), "weight", None)
            if dtensor is None or not isinstance(weight, dtensor) or all(p.is_replicate() for p in weight.placements):
                layouts.add(None)
                continue
            mesh, placements = weight.device_mesh, tuple(weight.placements)
            if mesh.ndim != 1 or len(placements) != 1 or not placements[0].is_shard(0):
                raise ValueError(
                    f"hashattention.patch supports tensor parallelism that shards {', '.join(HEAD_PROJECTIONS)} by "
                    f"output features (transformers' \"colwise\" plan, Shard(0) on a one-dimensional mesh); layer "
                    f"{index} {name}.weight is placed {placements} on a {mesh.ndim}-dimensional mesh"
                )
            layouts.add((mesh.size(), mesh.get_local_rank()) if mesh.size() > 1 else None)
    if len(layouts) > 1:
        raise ValueError(
            f"hashattention.patch needs every attention layer's {', '.join(HEAD_PROJECTIONS)} placed alike (all "
            f"sharded by heads over one mesh, or none); found the layouts {sorted(layouts, key=str)} "
            "(None: not sharded; otherwise (tensor-parallel size, rank))"
        )
    layout = layouts.pop() if layouts else None
    if layout is None:
        return None
    world_size, rank = layout
    check_divisible(num_query_heads, num_kv_heads, world_size)
    return HeadShard(rank=rank, world_size=world_size, num_query_heads=num_query_heads, num_kv_heads=num_kv_heads)


def shard_adapters(adapters: HashAdapters, shard: HeadShard) -> HashAdapters:
    """This rank's slice of full adapters: new :class:`HashAdapters` with copied weights.

    Every layer's query stack keeps the heads ``shard.query_heads`` and its key stack the heads
    ``shard.key_signature_heads(key_heads)``: weights ``(Hq, in, out) -> (Hq / W, in, out)``, biases
    ``(Hq, out) -> (Hq / W, out)`` (likewise for the key heads). Dtypes, devices and ``requires_grad``
    are kept; the config gets the local head counts. The slices are copies, so they do not follow
    later in-place edits of ``adapters``.
    """
    config = adapters.config
    if (config.num_query_heads, config.num_kv_heads) != (shard.num_query_heads, shard.num_kv_heads):
        raise ValueError(
            f"shard_adapters: adapters.config has {config.num_query_heads} query / {config.num_kv_heads} KV heads, "
            f"the shard is of a model with {shard.num_query_heads} / {shard.num_kv_heads}"
        )
    local_config = dataclasses.replace(
        config, num_query_heads=shard.local_query_heads, num_kv_heads=shard.local_kv_heads,
        training=dict(config.training), validation=dict(config.validation),
    )
    ranges = {"query": shard.query_heads, "key": shard.key_signature_heads(config.key_heads)}
    state = {}
    for name, tensor in adapters.state_dict().items():
        side = name.split(".")[2]  # layers.<index>.<query | key>.<weights | biases>.<position>
        heads = ranges[side]
        state[name] = tensor.detach()[heads.start : heads.stop].clone()
    with torch.device("meta"):  # no initialisation: every tensor is replaced by its slice below
        sliced = HashAdapters(local_config)
    sliced.load_state_dict(state, assign=True)  # assign: each tensor keeps its own dtype and device
    return sliced.train(adapters.training)


def expected_adapter_heads(config: AdapterConfig, shard: HeadShard) -> Tuple[int, int]:
    """``(query heads, KV heads)`` that adapters with ``config`` are checked against on this rank: the
    model's when they are the full adapters, the rank's when they are already its slice; any other
    pair is a ValueError naming both accepted layouts."""
    heads = (config.num_query_heads, config.num_kv_heads)
    if heads in ((shard.num_query_heads, shard.num_kv_heads), (shard.local_query_heads, shard.local_kv_heads)):
        return heads
    raise ValueError(
        f"adapters do not fit this model's {shard.describe()}: adapters.config has {heads[0]} query / {heads[1]} KV "
        f"heads; pass the full adapters ({shard.num_query_heads} / {shard.num_kv_heads}, sliced per rank by patch) "
        f"or this rank's slice ({shard.local_query_heads} / {shard.local_kv_heads})"
    )


def adapters_for_shard(adapters: HashAdapters, shard: HeadShard) -> HashAdapters:
    """The adapters rank ``shard.rank`` runs: full adapters are sliced (:func:`shard_adapters`);
    adapters already holding exactly the rank's head counts are used as they are (the caller sliced
    them for this rank: which heads they were trained on cannot be checked); anything else is the
    ValueError of :func:`expected_adapter_heads`."""
    heads = expected_adapter_heads(adapters.config, shard)
    if heads == (shard.num_query_heads, shard.num_kv_heads):
        return shard_adapters(adapters, shard)
    return adapters
