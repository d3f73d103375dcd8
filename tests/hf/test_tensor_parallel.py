"""Tensor-parallel patching end to end: 2 torchrun processes (gloo, CPU) against one process.

One torchrun launch (``tensor_parallel_worker.py``) runs every case on the tiny Llama and Mistral
sharded with ``tp_plan="auto"`` (2 query heads and 1 KV head per rank); each test compares what
every rank got with the same run of :mod:`tensor_parallel_helpers` on the unsharded model.
"""

import os
import subprocess

import pytest
import torch
from transformers import DynamicCache

from hashattention.patching import patch

from hf_models import random_ids
from tensor_parallel_helpers import (FULL_BUDGET_RUNS, KINDS, SPARSE_RUNS, adapters_for, greedy_generation,
                                     launch_command, load, run_patched, subprocess_env, teacher_forced_logits,
                                     write_models)

pytestmark = pytest.mark.slow
RANKS = 2
LOGIT_TOLERANCE = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tensor_parallel_models"))
    write_models(directory)
    return directory


@pytest.fixture(scope="module")
def ranks(models, tmp_path_factory):
    """Every rank's results (a list indexed by rank)."""
    out = str(tmp_path_factory.mktemp("tensor_parallel_results"))
    result = subprocess.run(launch_command(models, out), env=subprocess_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return [torch.load(os.path.join(out, f"rank{rank}.pt")) for rank in range(RANKS)]


@pytest.mark.parametrize("run", FULL_BUDGET_RUNS, ids=lambda run: run.name)
def test_full_budget_logits_equal_the_unsharded_model(ranks, models, run):
    """At a budget of every key each rank's logits, step by step, are the unsharded dense model's."""
    want = teacher_forced_logits(load(models, run.kind, tensor_parallel=False), run.cache)
    for rank, results in enumerate(ranks):
        for step, (got, expected) in enumerate(zip(results["runs"][run.name], want, strict=True)):
            torch.testing.assert_close(got, expected, **LOGIT_TOLERANCE, msg=lambda m: f"rank {rank} step {step}: {m}")


@pytest.mark.parametrize("run", SPARSE_RUNS, ids=lambda run: run.name)
def test_sparse_generation_equals_the_single_process_patch(ranks, models, run):
    """With a small budget every rank generates the single-process patched model's greedy tokens."""
    model = load(models, run.kind, tensor_parallel=False)
    want = run_patched(model, run)
    dense = greedy_generation(model, run.cache)
    # The budget is small enough to matter, so this compares selections, not dense attention.
    assert (want["scores"] - dense["scores"]).abs().max() > 1e-2
    for rank, results in enumerate(ranks):
        got = results["runs"][run.name]
        assert torch.equal(got["sequences"], want["sequences"]), f"rank {rank}"
        torch.testing.assert_close(got["scores"], want["scores"], **LOGIT_TOLERANCE, msg=lambda m: f"rank {rank}: {m}")


@pytest.mark.parametrize("kind", KINDS)
def test_adapters_sliced_by_the_caller_equal_the_full_ones(ranks, kind):
    run = next(run for run in SPARSE_RUNS if run.kind == kind and run.key_heads == "query")
    for results in ranks:
        full, presliced = results["runs"][run.name], results["runs"][f"{kind}-presliced"]
        assert torch.equal(full["sequences"], presliced["sequences"])
        assert torch.equal(full["scores"], presliced["scores"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("key_heads", ["query", "kv"])
def test_each_rank_caches_the_signatures_of_its_own_heads(ranks, models, kind, key_heads):
    model = load(models, kind, tensor_parallel=False)
    cache = DynamicCache(config=model.config)
    with patch(model, adapters_for(model, key_heads)), torch.no_grad():
        model(input_ids=random_ids(1, 24, seed=5), past_key_values=cache, use_cache=True)
    for rank, results in enumerate(ranks):
        assert results[f"{kind}-heads"] == (rank, RANKS, (2 * rank, 2 * rank + 1), (rank,))
        heads = [2 * rank, 2 * rank + 1] if key_heads == "query" else [rank]
        for layer, got in enumerate(results["signatures"][f"{kind}-{key_heads}"]):
            assert torch.equal(got, cache.layers[layer].key_signatures[:, heads]), f"rank {rank} layer {layer}"


def test_refusals_name_the_problem_and_leave_the_model_untouched(ranks):
    for rank, results in enumerate(ranks):
        errors = results["errors"]
        for kind in KINDS:
            refused = errors[f"{kind}-other-adapters"]
            assert refused["untouched"], rank
            assert f"tensor-parallel rank {rank} of 2" in refused["message"]
            assert "4 query / 4 KV heads; pass the full adapters (4 / 2" in refused["message"]
            assert "or this rank's slice (2 / 1)" in refused["message"]
        refused = errors["indivisible-kv-heads"]
        assert refused["untouched"], rank
        assert "num_key_value_heads (1) to be divisible by the tensor-parallel size (2)" in refused["message"]
        refused = errors["rowwise-q-proj"]
        assert refused["untouched"], rank
        assert "layer 0 q_proj.weight is placed (Shard(dim=1),)" in refused["message"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_patched_decode_step_adds_no_collective(ranks, kind):
    """Selection runs on each rank's own heads: a sparse decode step issues exactly the collectives of a dense
    one (transformers' row-parallel reductions), which the profiler does see."""
    for rank in ranks:
        counts = rank["collectives"][kind]
        assert counts["dense"] > 0, counts
        assert counts["query_head-query"] == counts["dense"] and counts["kv_group-kv"] == counts["dense"], counts
