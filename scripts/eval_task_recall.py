"""Selection quality at the question of RULER-style task prompts (where a task is won or lost).

Recall on held-out prose does not predict task scores (README, evaluation section): this script
measures recall of the true top-k keys and attention mass at the sparse rows of the task prompts
themselves, per (selector, sparsity), averaged over layers and samples, with the same settings and
arguments as ``python -m hashattention.evaluation`` (no generation, nothing cached):

    python scripts/eval_task_recall.py --contexts 8192 --sparsities 16 --task-samples 2 \\
        --tasks niah_single,niah_multikey --selectors oracle,hashattention,quest \\
        --output-dir results/evaluation/smollm2-8k

Writes ``task_prompt_selection.{md,json}`` into ``--output-dir``.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hashattention.evaluation import cli  # noqa: E402
from hashattention.evaluation.metrics import mean_ignoring_none  # noqa: E402


def collect(evaluation):
    """``{(selector, sparsity): {task: [(recall, mass, needle kept) per sample]}}``, means over layers."""
    cfg = evaluation.config
    results = defaultdict(lambda: defaultdict(list))
    for context in cfg.contexts:
        for task in cfg.tasks:
            for index in range(cfg.task_samples):
                quality = evaluation.task_prompt_selection(task, context, index)
                for job, layers in quality.items():
                    results[job][task].append((mean_ignoring_none(layers["recall"]), mean_ignoring_none(layers["mass"]),
                                               layers["needle_kept"]))
                print(f"{task} {context} #{index}: " + ", ".join(
                    f"{n}@{s:g}x {fmt(mean_ignoring_none(l['recall']))}" for (n, s), l in quality.items()), flush=True)
    return results


def fmt(value) -> str:
    return "–" if value is None else f"{value:.3f}"


def table(results, tasks):
    """Means over every sample of every task, then per task: recall, and the needle attention kept."""
    lines = ["| selector | sparsity | recall@k | attention mass | needle attention kept | "
             + " | ".join(f"recall / kept {t}" for t in tasks) + " |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(tasks)]
    for (name, sparsity), per_task in results.items():
        every = [row for t in tasks for row in per_task.get(t, [])]
        cells = [f"{fmt(mean_ignoring_none([r[0] for r in per_task.get(t, [])]))} / {fmt(mean_ignoring_none([r[2] for r in per_task.get(t, [])]))}"
                 for t in tasks]
        lines.append(f"| {name} | {sparsity:g}x | {fmt(mean_ignoring_none([r[0] for r in every]))} | {fmt(mean_ignoring_none([r[1] for r in every]))} | "
                     f"{fmt(mean_ignoring_none([r[2] for r in every]))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = cli.build_parser().parse_args(argv)
    evaluation = cli.evaluation_from_args(args)
    results = collect(evaluation)
    cfg = evaluation.config
    text = (f"Selection quality at the last {cfg.sparse_prompt_tokens} rows of the task prompts (the question): "
            f"contexts {cfg.contexts}, {cfg.task_samples} sample(s) per task, top-k = {cfg.top_k}, "
            f"sink {cfg.sink_tokens} + local {cfg.local_tokens}; means over layers, then samples. Needle attention "
            "kept: at the last prompt row, the share of the dense model's attention to the answers' tokens in the "
            "prompt that the selection keeps, summed over layers and heads (so the heads that attend to the needle "
            "weigh the most; – where the answers are not in the prompt verbatim).\n\n"
            + table(results, cfg.tasks) + "\n")
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, "task_prompt_selection.md"), "w") as f:
        f.write(text)
    with open(os.path.join(cfg.output_dir, "task_prompt_selection.json"), "w") as f:
        json.dump([{"selector": n, "sparsity": s, "tasks": {t: [list(p) for p in v] for t, v in per_task.items()}}
                   for (n, s), per_task in results.items()], f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
