"""``benchmarks.generate`` under ``torchrun``: the model shapes and the tensor-parallel model of every rank.

Under ``--tensor-parallel`` each torchrun process is one rank of transformers' tensor parallelism
(``DistributedConfig(tp_plan="auto")``): the Llama plan shards ``q_proj``, ``k_proj``, ``v_proj``,
``gate_proj``, ``up_proj`` and ``lm_head`` by output features and ``o_proj``, ``down_proj`` by input
features; the embedding table and the norms are replicated. transformers picks the device
(``cuda:LOCAL_RANK`` with NCCL, or the CPU with gloo on a host without an accelerator).

The model is built without a checkpoint by ``from_pretrained(None, config=..., state_dict=...)``:
transformers creates it on the meta device, replaces the planned parameters by ``DTensor``
placeholders of the rank's shard, then either shards the tensors of ``state_dict`` (the loader
keeps only the rank's slice) or, for the keys missing from it, allocates the rank's local shard
on the device and runs the model's weight initialisation on it. Two ways follow:

* ``seeded`` (the default of ``--tiny``): the single-process benchmark's model (the same seed, built
  whole on the CPU) is passed as ``state_dict``, so a rank's shards are slices of exactly the
  weights a single-process run uses and the two runs' tokens can be compared. Every rank holds the
  whole model on the host while it loads: for small models only.
* ``sharded`` (the default of the 8B / 70B shapes): ``state_dict={}``, so every weight is a missing
  key and each rank allocates and initialises only its own shards (N(0, initializer_range) weights,
  unit norms) on its device; no rank ever holds the whole model. The replicated weights are equal
  on every rank (the same seed, the same initialisation order); the sharded ones are random per
  shard, which a throughput benchmark does not care about.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

import torch

#: ``--model`` names: the decoder shape of each (Llama-3.1 RoPE, vocabulary and norms in all).
MODEL_SHAPES: Dict[str, dict] = {
    "llama-8b-shape": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "llama-70b-shape": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                            num_attention_heads=64, num_key_value_heads=8, head_dim=128),
}
MODEL_LABELS = {"llama-8b-shape": "Llama-3.1-8B shape", "llama-70b-shape": "Llama-3.1-70B shape"}
DEFAULT_MODEL = "llama-8b-shape"
WEIGHTS = ("seeded", "sharded")


def model_config(args, max_positions: int):
    """The config of ``--tiny`` or ``--model`` (``--layers`` overrides the layer count)."""
    from benchmarks.decode_loop import model_config as base_config

    config = base_config(args, max_positions)  # the tiny model, or the 8B shape with its RoPE and norms
    if not args.tiny:
        shape = dict(MODEL_SHAPES[args.model])
        if args.layers:
            shape["num_hidden_layers"] = args.layers
        for name, value in shape.items():
            setattr(config, name, value)
    return config


def model_label(args) -> str:
    return "tiny Llama" if args.tiny else MODEL_LABELS[args.model]


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def check_launch(config, device: Optional[str]) -> int:
    """The world size of this torchrun launch; ValueError where tensor parallelism cannot run."""
    if not launched_by_torchrun():
        raise ValueError("--tensor-parallel needs a torchrun launch (RANK, LOCAL_RANK and WORLD_SIZE unset), e.g. "
                         "torchrun --nproc_per_node 2 -m benchmarks.generate --tensor-parallel ...")
    world = int(os.environ["WORLD_SIZE"])
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name)
        if heads % world:
            raise ValueError(f"--tensor-parallel over {world} processes needs the model's {name} ({heads}) to be "
                             f"divisible by {world}: each rank computes whole heads")
    accelerator = torch._C._get_accelerator().type
    if device is not None and torch.device(device).type != accelerator:
        # transformers places rank r on the accelerator (cuda:LOCAL_RANK) or, on a host without one, the CPU.
        raise ValueError(f"--tensor-parallel runs on the device transformers picks for the ranks ({accelerator} on "
                         f"this host); --device {device} cannot be honoured")
    return world


def build_model(config, dtype, weights: str, seed: int):
    """This rank's model: ``DTensor`` shards of the planned weights on the rank's device, in ``dtype``.

    ``weights``: ``"seeded"`` (slices of the single-process model seeded with ``seed``) or
    ``"sharded"`` (each rank initialises only its shards; see the module docstring).
    """
    from transformers import DistributedConfig, LlamaForCausalLM

    from benchmarks.decode_loop import build_model as build_whole

    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    torch.manual_seed(seed)  # the replicated weights (and, seeded, all of them) equal on every rank
    state = {}
    if weights == "seeded":
        # The same call and seed as the single-process benchmark, so the loader slices the same tensors.
        state = build_whole(config, torch.device("cpu"), dtype).state_dict()
    model = LlamaForCausalLM.from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                             distributed_config=DistributedConfig(tp_plan="auto"))
    del state
    model.eval().requires_grad_(False)
    return model


def rank_adapters(model, family: str, dtype, seed: int):
    """This rank's slice of random adapters of ``family`` (``"query"`` / ``"kv"`` key heads) on its device.

    The full adapters are drawn on the CPU from ``seed`` (equal on every rank whatever the devices'
    random states) and sliced here, so a rank keeps only its heads' MLPs; ``patch`` uses a slice
    of exactly the rank's head counts as it is."""
    from hashattention import HashAdapters
    from hashattention.patching import decoder_layers
    from hashattention.tensor_parallel import head_shard, shard_adapters

    config = model.config
    shard = head_shard([layer.self_attn for layer in decoder_layers(model)], config.num_attention_heads,
                       config.num_key_value_heads)
    if shard is None:
        raise ValueError("the tensor-parallel model's attention projections are not sharded by heads")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        full = HashAdapters.for_model_config(config, key_heads=family)
    return shard_adapters(full, shard).to(device=model.device, dtype=dtype).eval().requires_grad_(False)


def local_bytes(tensor) -> int:
    """Bytes this process holds of a parameter (a ``DTensor``'s local shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def rank_parameter_bytes(model) -> int:
    return sum(local_bytes(p) for p in model.parameters())


def any_rank(flag: bool, device) -> bool:
    """Whether ``flag`` is true on some rank: every rank must take the same branch around a collective
    (a row one rank skips while another runs it would leave the other waiting in its all-reduce)."""
    import torch.distributed as dist

    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def rank_and_world() -> tuple:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def finish() -> None:
    """Wait for every rank (rank 0 may still be writing) and close the process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
