"""Which layers' selections lose the task answers: HashAttention with the exact top-k in some layers.

A diagnostic for the evaluation's task gap (README, evaluation section). On the task prompts where
the exact top-k oracle scores higher than HashAttention per query head (read from an evaluation
folder's ``samples.jsonl``), it reruns the prompt with HashAttention in every layer except one
group, where the exact top-k selects instead (same budget, same sparse attention). A group whose
swap recovers the answers is where the learned signatures lose them. The prompts and settings are
those of ``python -m hashattention.evaluation`` (same flags), so the swapped rows sit next to the
plain ones in the same per-sample cache and resume like them:

    cp results/evaluation/smollm2-8k-tasks32/samples.jsonl results/evaluation/smollm2-8k-layer-swap/
    python scripts/eval_layer_swap.py --contexts 8192 --sparsities 16 --task-samples 32 --threads 2 \\
        --layer-groups 0-9,10-19,20-29 --output-dir results/evaluation/smollm2-8k-layer-swap

Writes ``layer_swap.md`` into ``--output-dir``: per group, the summed score over the prompts, next to
HashAttention everywhere, the oracle everywhere, dense, and the ``--controls`` selectors (default
group-shared HashAttention) on the same prompts. The prompts were picked because HashAttention lost
them, so any other selection, better or not, wins some back by chance: a group matters only as far
as it beats the controls.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hashattention.evaluation import attention_hook, cli  # noqa: E402
from hashattention.evaluation.selectors import SelectorSetup  # noqa: E402
from hashattention.evaluation.selectors.hashattention_selector import HashAttentionSelector  # noqa: E402
from hashattention.evaluation.selectors.oracle import ExactTopK  # noqa: E402
from hashattention.evaluation.store import fingerprint  # noqa: E402

BASE_SELECTORS = ["full", "oracle", "hashattention"]


class OracleInLayers(HashAttentionSelector):
    """HashAttention per query head, except in ``oracle_layers``, where the exact top-k selects."""

    # No registry name: the evaluation's selector registry discovers every named subclass once this
    # module is imported, and this one is built here per layer group, never by name.
    name = ""

    def __init__(self, oracle_layers=()):
        super().__init__(selection="query")
        self.oracle_layers = frozenset(oracle_layers)
        self.oracle = ExactTopK()

    def identity(self):
        return {**super().identity(), "selector": "hashattention-oracle-layers", "oracle_layers": sorted(self.oracle_layers)}

    def select(self, layer, query, key, value, budget, scaling):
        chosen = self.oracle if layer in self.oracle_layers else super()
        return chosen.select(layer, query, key, value, budget, scaling)


def parse_layer_groups(text: str, num_layers: int) -> List[Tuple[str, List[int]]]:
    """``"0-9,10-19"`` -> ``[("0-9", [0..9]), ("10-19", [10..19])]``; a ValueError names a bad group."""
    groups = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        first, _, last = part.partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"--layer-groups: {part!r} is not a layer or a range like 10-19") from None
        if not 0 <= lo <= hi < num_layers:
            raise ValueError(f"--layer-groups: {part!r} is outside the model's layers 0-{num_layers - 1}")
        groups.append((part, list(range(lo, hi + 1))))
    if not groups:
        raise ValueError("--layer-groups must name at least one layer group")
    return groups


def losing_prompts(samples_path: str, tasks) -> List[Tuple[str, int, int]]:
    """``(task, context, sample)`` of the prompts where the oracle outscores HashAttention per query head."""
    scores: Dict[Tuple[str, int, int], Dict[str, float]] = defaultdict(dict)
    with open(samples_path) as f:
        for line in f:
            row = json.loads(line)
            if row.get("kind") == "task" and row["task"] in tasks:
                scores[(row["task"], row["context"], row["sample"])][row["selector"]] = row["score"]
    return sorted(k for k, v in scores.items()
                  if "oracle" in v and "hashattention" in v and v["oracle"] > v["hashattention"])


def main(argv=None) -> int:
    parser = cli.build_parser()
    parser.add_argument("--layer-groups", default="0-9,10-19,20-29",
                        help="comma-separated layer ranges; each is swapped to the exact top-k on its own")
    parser.add_argument("--controls", type=cli._names, default=["hashattention-group"],
                        help="selectors run on the same prompts for comparison: the prompts are chosen because "
                             "HashAttention lost them, so any other selection wins some back by chance")
    args = parser.parse_args(argv)
    controls = [c for c in args.controls if c not in BASE_SELECTORS]
    args.selectors = BASE_SELECTORS + controls
    evaluation = cli.evaluation_from_args(args)
    cfg = evaluation.config
    samples_path = os.path.join(cfg.output_dir, "samples.jsonl")
    if not os.path.isfile(samples_path):
        raise SystemExit(f"{samples_path} is missing: copy an evaluation folder's samples.jsonl there first")
    prompts = [p for p in losing_prompts(samples_path, cfg.tasks)
               if p[1] in cfg.contexts and p[2] < cfg.task_samples]
    groups = parse_layer_groups(args.layer_groups, evaluation.shape.num_layers)
    print(f"{len(prompts)} prompts where the oracle outscores HashAttention; groups {[g for g, _ in groups]}", flush=True)
    torch.manual_seed(cfg.seed)
    with attention_hook.evaluation_attention(evaluation.model):
        evaluation.prepare_selectors()
        setup = SelectorSetup(shape=evaluation.shape, adapters_dir=cfg.adapters_dir, seed=cfg.seed)
        for label, layers in groups:
            selector = OracleInLayers(layers)
            selector.prepare(setup)
            name = f"hashattention-oracle-layers-{label}"
            evaluation.selectors[name] = selector
            evaluation.fingerprints[name] = fingerprint({**cfg.result_settings(), **selector.identity()})

        class _Bar:  # _run_task counts jobs on a progress bar; print instead
            n = 0

            def update(self, k):
                self.n += k

        for task, context, index in prompts:
            evaluation._run_task(task, context, index, _Bar())
            print(f"{task} {context} #{index} done", flush=True)

    totals = defaultdict(float)
    with open(samples_path) as f:
        rows = [json.loads(line) for line in f]
    wanted = set(prompts)
    for row in rows:
        if row.get("kind") != "task" or (row["task"], row["context"], row["sample"]) not in wanted:
            continue
        name = row["selector"]
        if name in evaluation.fingerprints and row["key"].startswith(evaluation.fingerprints[name]):
            totals[name] += row["score"]
    lines = [f"Layer swap over the {len(prompts)} task prompts (of {cfg.task_samples} samples per task, "
             f"contexts {cfg.contexts}, {cfg.sparsities[0]:g}x) where the exact top-k oracle outscores HashAttention "
             "per query head: the summed score with the exact top-k in one layer group and HashAttention in the "
             "others. The prompts were chosen because HashAttention lost them, so any other selection wins some "
             "back by chance: compare the groups with the control rows (" + (", ".join(controls) or "none")
             + "), not with zero.\n", "| selection | summed score | recovered of the oracle's lead |", "|---|---:|---:|"]
    lead = totals["oracle"] - totals["hashattention"]
    controls = [c for c in controls if c in evaluation.selectors]  # an unavailable control has no rows
    for name in BASE_SELECTORS + controls + [f"hashattention-oracle-layers-{g}" for g, _ in groups]:
        recovered = (totals[name] - totals["hashattention"]) / lead if lead else float("nan")
        lines.append(f"| {name} | {totals[name]:.2f} | {recovered:.0%} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(cfg.output_dir, "layer_swap.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
