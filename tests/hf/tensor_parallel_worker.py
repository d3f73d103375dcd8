"""torchrun worker of ``test_tensor_parallel.py``: the runs of :mod:`tensor_parallel_helpers` on models
sharded over the torchrun processes (``tp_plan="auto"``, gloo on CPU), saved per rank for the test
to compare with the unsharded model.

    python -m torch.distributed.run --nproc_per_node 2 tests/hf/tensor_parallel_worker.py MODELS OUT

writes ``OUT/rank<r>.pt``: a dict of every run's result by name, the signature caches of one
forward, the rank's heads, and the messages of the calls that must fail.
"""

import os
import sys

import torch
import torch.distributed as dist
from transformers import DynamicCache

from hashattention.config import HashAttentionConfig
from hashattention.patching import decoder_layers, is_patched, patch
from hashattention.tensor_parallel import head_shard, shard_adapters

from hf_models import random_ids, tiny_adapters, tiny_model
from tensor_parallel_helpers import (FULL_BUDGET_RUNS, KINDS, SINGLE_KV_HEAD, SPARSE_RUNS, adapters_for, load,
                                     run_patched)


def untouched(model) -> bool:
    """Nothing of a refused patch is left on the model."""
    return (not is_patched(model) and model.config._attn_implementation == "sdpa"
            and all(not layer.self_attn._forward_pre_hooks for layer in decoder_layers(model)))


def refusal(model, adapters) -> dict:
    """The ValueError ``patch`` raises (None if it patched) and whether the model was left as it was."""
    try:
        patch(model, adapters)
    except ValueError as error:
        return {"message": str(error), "untouched": untouched(model)}
    return {"message": None, "untouched": untouched(model)}


def signature_caches(model, key_heads: str) -> list:
    """Every layer's key signatures ``(1, Hk / W, 24, 1)`` after a patched prefill of 24 tokens."""
    cache = DynamicCache(config=model.config)
    with patch(model, adapters_for(model, key_heads)), torch.no_grad():
        model(input_ids=random_ids(1, 24, seed=5), past_key_values=cache, use_cache=True)
    return [layer.key_signatures for layer in cache.layers]


COLLECTIVES = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast", "all_to_all",
               "alltoall")


def decode_step_collectives(model, config=None, key_heads: str = "query") -> int:
    """Collective operations the profiler records in one decode step (after a 24-token prefill), dense when
    ``config`` is None, else patched with it: a rank's selection must add none to transformers' own."""
    from torch.profiler import ProfilerActivity, profile

    def step():
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=random_ids(1, 24, seed=6), past_key_values=cache, use_cache=True)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                model(input_ids=random_ids(1, 1, seed=7), past_key_values=cache, use_cache=True)
        # Top-level events only: a collective's own nested records (gloo:..., c10d::...) would count twice.
        names = [event.name.lower() for event in prof.events() if event.cpu_parent is None]
        return sum(any(c in name for c in COLLECTIVES) for name in names)

    if config is None:
        return step()
    with patch(model, adapters_for(model, key_heads), config):
        return step()


def main(models: str, out: str) -> None:
    results = {"runs": {}, "signatures": {}, "errors": {}, "collectives": {}}
    for kind in KINDS:
        model = load(models, kind, tensor_parallel=True)
        results["collectives"][kind] = {
            "dense": decode_step_collectives(model),
            **{f"{selection}-{key_heads}": decode_step_collectives(
                model, HashAttentionConfig(budget_tokens=8, sink_tokens=2, local_tokens=2, selection=selection),
                key_heads) for selection, key_heads in (("query_head", "query"), ("kv_group", "kv"))},
        }
        for run in FULL_BUDGET_RUNS + SPARSE_RUNS:
            if run.kind == kind:
                results["runs"][run.name] = run_patched(model, run)
        for key_heads in ("query", "kv"):
            results["signatures"][f"{kind}-{key_heads}"] = signature_caches(model, key_heads)
        config = model.config
        shard = head_shard([layer.self_attn for layer in decoder_layers(model)], config.num_attention_heads,
                           config.num_key_value_heads)
        results[f"{kind}-heads"] = (shard.rank, shard.world_size, tuple(shard.query_heads), tuple(shard.kv_heads))
        # Adapters the caller already sliced for this rank run like the full ones.
        presliced = shard_adapters(adapters_for(model, "query"), shard)
        run = next(run for run in SPARSE_RUNS if run.kind == kind and run.key_heads == "query")
        results["runs"][f"{kind}-presliced"] = run_patched(model, run, adapters=presliced)
        other = tiny_model(kind)
        other.config.num_key_value_heads = 4  # adapters of a 4-query / 4-KV-head model: neither layout fits
        results["errors"][f"{kind}-other-adapters"] = refusal(model, tiny_adapters(other))
        del model
    one_kv = load(models, SINGLE_KV_HEAD, tensor_parallel=True)
    results["errors"]["indivisible-kv-heads"] = refusal(one_kv, tiny_adapters(one_kv))
    # A plan that splits q_proj by input features: each rank would hold a part of every head.
    plan = {f"model.layers.*.self_attn.{name}": "colwise" for name in ("k_proj", "v_proj")}
    plan.update({"model.layers.*.self_attn.q_proj": "rowwise", "model.layers.*.self_attn.o_proj": "rowwise"})
    rowwise = load(models, "llama", tensor_parallel=True, plan=plan)
    results["errors"]["rowwise-q-proj"] = refusal(rowwise, tiny_adapters(rowwise))
    torch.save(results, os.path.join(out, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
