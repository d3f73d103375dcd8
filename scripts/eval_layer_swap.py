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

``--head-sets copy-27,random-27`` swaps query heads instead of whole layers: the 27 heads with the
highest copy score (:func:`copy_head_scores`: attention from each token of a repeated random-token
sequence to the token after its first occurrence, the behaviour that copies a needle or a code word
into the answer; measured on the model alone, no task text), or 27 heads drawn at random (seeded) as
their control. ``--layer-groups ""`` runs the head sets alone.

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
from transformers import DynamicCache

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hashattention.evaluation import attention_hook, cli  # noqa: E402
from hashattention.evaluation.harness import _forward  # noqa: E402
from hashattention.evaluation.selectors import SelectorSetup  # noqa: E402
from hashattention.evaluation.selectors.base import Selector, grouped_logits  # noqa: E402
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


class OracleInHeads(HashAttentionSelector):
    """HashAttention per query head, except the ``(layer, query head)`` pairs of ``oracle_heads``,
    whose rows take the exact top-k's selection instead (same budget, same width)."""

    name = ""  # built per head set, never by registry name (see OracleInLayers)

    def __init__(self, oracle_heads=()):
        super().__init__(selection="query")
        self.oracle_heads = frozenset((int(layer), int(head)) for layer, head in oracle_heads)
        self.heads_by_layer: Dict[int, List[int]] = defaultdict(list)
        for layer, head in sorted(self.oracle_heads):
            self.heads_by_layer[layer].append(head)
        self.oracle = ExactTopK()

    def identity(self):
        return {**super().identity(), "selector": "hashattention-oracle-heads",
                "oracle_heads": [list(pair) for pair in sorted(self.oracle_heads)]}

    def select(self, layer, query, key, value, budget, scaling):
        learned = super().select(layer, query, key, value, budget, scaling)
        heads = self.heads_by_layer.get(layer)
        if not heads:
            return learned
        exact = self.oracle.select(layer, query, key, value, budget, scaling)
        swapped = torch.zeros(query.shape[1], dtype=torch.bool, device=query.device)
        swapped[heads] = True
        indices = torch.where(swapped.view(1, -1, 1, 1), exact[0], learned[0])
        counts = torch.where(swapped.view(1, -1, 1), exact[1], learned[1])
        return indices, counts


class _CopyScoreCapture(Selector):
    """Per query head of every layer: the mean attention of the second copy's rows to the token
    that followed the same token in the first copy (rows ``period .. 2 * period - 2``)."""

    name = ""

    def __init__(self, period: int):
        super().__init__()
        self.period = period
        self.scores: Dict[int, torch.Tensor] = {}

    def observe_dense(self, layer, query, key, scaling):
        keys, rows = key.shape[2], query.shape[2]
        logits = grouped_logits(query, key, scaling)[0]  # (Hq, L, N), rows at positions N - L .. N - 1
        positions = torch.arange(keys - rows, keys)
        causal = torch.arange(keys).view(1, -1) <= positions.view(-1, 1)
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        copy_rows = torch.arange(self.period, 2 * self.period - 1)  # the last row's target is outside the copy
        targets = copy_rows - self.period + 1
        local = copy_rows - (keys - rows)
        self.scores[layer] = probs[:, local, targets].mean(dim=-1)


def copy_head_scores(model, period: int = 256, seed: int = 0) -> torch.Tensor:
    """float32 ``(num_layers, num_query_heads)`` copy scores of ``model`` (in [0, 1]).

    The model reads ``period`` random token ids (from the upper 90% of its vocabulary, away from
    special tokens) twice in a row, densely; a head's score is the mean attention, over the second
    copy's rows, to the position right after the current token's first occurrence: the induction /
    copy pattern a retrieval task needs (a needle's next digit, a code word's next piece).
    """
    if period < 2:
        raise ValueError(f"period must be >= 2, got {period}")
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab // 10, vocab, (period,), generator=generator).tolist()
    capture = _CopyScoreCapture(period)
    with attention_hook.evaluation_attention(model), attention_hook.activate(attention_hook.SparseRun(selector=capture)):
        _forward(model, tokens + tokens, DynamicCache(config=model.config))
    return torch.stack([capture.scores[layer] for layer in sorted(capture.scores)])


def parse_head_sets(text: str) -> List[Tuple[str, int]]:
    """``"copy-27,random-27"`` -> ``[("copy", 27), ("random", 27)]``; a ValueError names a bad set."""
    sets = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        kind, _, count = part.partition("-")
        if kind not in ("copy", "random") or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--head-sets: {part!r} is not copy-N or random-N with N >= 1")
        sets.append((kind, int(count)))
    return sets


def choose_heads(kind: str, count: int, copy_scores: torch.Tensor, seed: int = 0) -> List[Tuple[int, int]]:
    """``count`` ``(layer, query head)`` pairs: the highest copy scores, or a seeded random draw."""
    layers, heads = copy_scores.shape
    if count > layers * heads:
        raise ValueError(f"--head-sets: {kind}-{count} asks for more than the model's {layers * heads} heads")
    if kind == "copy":
        flat = torch.argsort(copy_scores.flatten(), descending=True, stable=True)[:count]
    else:
        flat = torch.randperm(layers * heads, generator=torch.Generator().manual_seed(seed))[:count]
    return sorted((int(i) // heads, int(i) % heads) for i in flat)


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
    parser.add_argument("--head-sets", default="",
                        help="comma-separated copy-N / random-N: the N query heads of highest copy score, or N "
                             "random ones, swapped to the exact top-k together (in every layer they are in)")
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
    head_sets = parse_head_sets(args.head_sets)
    if not groups and not head_sets:
        raise SystemExit("--layer-groups and --head-sets are both empty: nothing to swap")
    swaps: List[Tuple[str, Selector]] = [(f"hashattention-oracle-layers-{label}", OracleInLayers(layers))
                                         for label, layers in groups]
    head_notes = []
    if head_sets:
        copy_scores = copy_head_scores(evaluation.model, seed=cfg.seed)
        for kind, count in head_sets:
            chosen = choose_heads(kind, count, copy_scores, seed=cfg.seed)
            head_notes.append(f"- `{kind}-{count}`: mean copy score {copy_scores[tuple(zip(*chosen))].mean():.3f} "
                              f"(all heads {copy_scores.mean():.3f}); (layer, query head) "
                              + ", ".join(f"{layer}.{head}" for layer, head in chosen))
            print(head_notes[-1], flush=True)
            swaps.append((f"hashattention-oracle-heads-{kind}-{count}", OracleInHeads(chosen)))
    print(f"{len(prompts)} prompts where the oracle outscores HashAttention; swaps {[n for n, _ in swaps]}", flush=True)
    torch.manual_seed(cfg.seed)
    with attention_hook.evaluation_attention(evaluation.model):
        evaluation.prepare_selectors()
        setup = SelectorSetup(shape=evaluation.shape, adapters_dir=cfg.adapters_dir, seed=cfg.seed)
        for name, selector in swaps:
            selector.prepare(setup)
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
             "per query head: the summed score with the exact top-k in one layer group (or one set of query heads) "
             "and HashAttention in the others. The prompts were chosen because HashAttention lost them, so any other selection wins some "
             "back by chance: compare the groups with the control rows (" + (", ".join(controls) or "none")
             + "), not with zero.\n", "| selection | summed score | recovered of the oracle's lead |", "|---|---:|---:|"]
    lead = totals["oracle"] - totals["hashattention"]
    controls = [c for c in controls if c in evaluation.selectors]  # an unavailable control has no rows
    for name in BASE_SELECTORS + controls + [n for n, _ in swaps]:
        recovered = (totals[name] - totals["hashattention"]) / lead if lead else float("nan")
        lines.append(f"| {name} | {totals[name]:.2f} | {recovered:.0%} |")
    if head_notes:
        lines += ["", "Head sets (copy score: attention to the token after the current token's first occurrence "
                  "in a repeated random-token sequence, `copy_head_scores`):", *head_notes]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(cfg.output_dir, "layer_swap.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
