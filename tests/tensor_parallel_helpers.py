"""The runs that the tensor-parallel tests compare: one definition, run by the torchrun workers on a
sharded model and by the test process on the unsharded one.

Each run patches a model, feeds it fixed inputs and returns what is compared: logits per step
(teacher-forced, so both sides see the same tokens) or greedy ``generate`` output. The models are
the tiny ones of :mod:`hf_models` saved with ``save_pretrained``, so both sides load the same weights.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Dict, List, Optional

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaForCausalLM, StaticCache

from hashattention.config import HashAttentionConfig
from hashattention.patching import patch

from hf_models import left_padded_batch, random_ids, tiny_adapters, tiny_model

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO_ROOT, "tests", "hf", "tensor_parallel_worker.py")
KINDS = ("llama", "mistral")
PROMPT, STEPS = 40, 6
#: A tiny Llama with 4 query heads and 1 KV head, which 2 ranks cannot split.
SINGLE_KV_HEAD = "llama-one-kv-head"


@dataclasses.dataclass(frozen=True)
class Run:
    """One patched run: ``budget`` None is the full budget (every key, so equal to dense attention)."""

    kind: str
    selection: str
    key_heads: str
    cache: str  # "dynamic" or "static"
    budget: Optional[int] = None

    @property
    def name(self) -> str:
        budget = "full" if self.budget is None else f"budget{self.budget}"
        return f"{self.kind}-{self.selection}-{self.key_heads}-{self.cache}-{budget}"

    def config(self) -> HashAttentionConfig:
        budget = PROMPT + STEPS if self.budget is None else self.budget
        return HashAttentionConfig(sink_tokens=3, local_tokens=4, budget_tokens=budget, sparse_prompt_tokens=8,
                                   selection=self.selection)


#: Full budget: logits of every step against the unsharded, unpatched model.
FULL_BUDGET_RUNS = [Run(kind, selection, "query", cache) for kind in KINDS
                    for selection in ("query_head", "kv_group") for cache in ("dynamic", "static")]
#: A small budget: greedy generation against the single-process patched model.
SPARSE_RUNS = [Run(kind, selection, key_heads, cache, budget=13) for kind in KINDS
               for selection, key_heads in (("query_head", "query"), ("kv_group", "kv"))
               for cache in ("dynamic", "static")]


def write_models(directory: str) -> None:
    """The tiny Llama and Mistral of :func:`hf_models.tiny_model` and a Llama with one KV head, saved."""
    for kind in KINDS:
        tiny_model(kind).save_pretrained(os.path.join(directory, kind))
    config = tiny_model("llama").config
    config.num_key_value_heads = 1
    LlamaForCausalLM(config).save_pretrained(os.path.join(directory, SINGLE_KV_HEAD))


def load(directory: str, name: str, tensor_parallel: bool, plan: Optional[Dict[str, str]] = None):
    """A saved model in float32, whole or sharded over the torchrun processes with the model's own plan
    (``tp_plan="auto"``) or ``plan``."""
    kwargs = {}
    if tensor_parallel:
        from transformers import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_plan="auto" if plan is None else plan)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(directory, name), dtype=torch.float32, **kwargs)
    return model.eval()


def adapters_for(model, key_heads: str):
    """The full adapters of :func:`hf_models.tiny_adapters` (seeded: equal in every process)."""
    return tiny_adapters(model, key_heads=key_heads)


def teacher_forced_logits(model, cache_kind: str) -> List[torch.Tensor]:
    """Prefill a fixed prompt, then ``STEPS`` decode steps on fixed tokens: ``[(1, PROMPT, V), (1, 1, V), ...]``."""
    ids = random_ids(1, PROMPT, seed=3)
    tokens = random_ids(1, STEPS, seed=4)
    cache = (DynamicCache(config=model.config) if cache_kind == "dynamic"
             else StaticCache(config=model.config, max_cache_len=PROMPT + STEPS))
    outputs = []
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        outputs.append(out.logits)
        for step in range(STEPS):
            out = model(input_ids=tokens[:, step : step + 1], past_key_values=cache, use_cache=True)
            outputs.append(out.logits)
    return outputs


def greedy_generation(model, cache_kind: str) -> Dict[str, torch.Tensor]:
    """Greedy ``generate`` on a left-padded batch of two prompts: ``{"sequences", "scores" (steps, B, V)}``."""
    _, ids, mask = left_padded_batch([PROMPT, PROMPT - 9], seed=10)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False, output_scores=True,
                             return_dict_in_generate=True,
                             cache_implementation=None if cache_kind == "dynamic" else "static")
    return {"sequences": out.sequences, "scores": torch.stack(out.scores)}


def run_patched(model, run: Run, adapters=None):
    """``run`` on ``model`` patched with ``adapters`` (default: the full adapters); unpatched after."""
    adapters = adapters_for(model, run.key_heads) if adapters is None else adapters
    with patch(model, adapters, run.config()):
        if run.budget is None:
            return teacher_forced_logits(model, run.cache)
        return greedy_generation(model, run.cache)


def launch_command(models: str, out: str) -> List[str]:
    """torchrun over 2 CPU processes (gloo) running the worker; ``--standalone`` picks a free port."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", WORKER, models, out]


def subprocess_env() -> dict:
    """The worker imports the repository's package and the test helpers; one thread per process."""
    env = dict(os.environ)
    paths = [REPO_ROOT, os.path.join(REPO_ROOT, "tests"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(path for path in paths if path)
    env["OMP_NUM_THREADS"] = "1"
    return env
