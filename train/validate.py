"""Held-out recall of the true top-k within the selection, per layer and budget.

For each held-out sequence, layer, sampled query at position ``p`` (``n = p + 1`` keys) and
sparsity ``s``, the selection has ``floor(n / s)`` tokens in total, windows included (the
integration's definition): the sink and local windows plus ``max(0, floor(n/s) − sink − local)``
heavy tokens chosen by the selector, all through the project's ops (one budget contract, ties to
the later position). Recall = |true top-k ∩ selection| / |true top-k|, with the true top-k the
``top_k`` eligible keys by q·k/√d of each query head (eligible = outside the windows, causal).

Selectors: ``learned`` (the adapters' packed signatures, :func:`hashattention.ops.hamming_topk`),
``lsh`` (random Gaussian projections with the same number of bits, the paper's Table 8 baseline;
the same projection for a query head and its keys) and ``oracle`` (the exact scores through
:func:`hashattention.ops.topk_from_scores`: the best any selector can do under this budget).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from hashattention import ops
from hashattention.adapters import HashAdapters, LayerAdapter

from .checkpoint import atomic_write
from .collect import require_shards
from .config import TrainConfig
from .distributed import DistributedContext
from .fit import load_layer_samples
from .labels import causal_keys, eligible_keys, target_scores

log = logging.getLogger(__name__)
METHODS = ("learned", "lsh", "oracle")


def row_budgets(positions: Tensor, sparsity: int, sink_tokens: int, local_tokens: int) -> Tensor:
    """int32 ``(Q,)`` heavy tokens per query row: ``max(0, floor((p + 1) / s) − sink − local)``."""
    total = torch.div(positions + 1, sparsity, rounding_mode="floor")
    return (total - sink_tokens - local_tokens).clamp_min(0).to(torch.int32)


def selection_mask(indices: Tensor, num_keys: int) -> Tensor:
    """bool ``(Q, Hs, N)`` from per-row op output ``indices`` int32 ``(Q, Hs, 1, K)`` (-1 = padding)."""
    rows, heads = indices.shape[0], indices.shape[1]
    flat = indices[:, :, 0, :].long()
    flat = torch.where(flat < 0, torch.full_like(flat, num_keys), flat)  # padding -> a spill column
    mask = torch.zeros(rows, heads, num_keys + 1, dtype=torch.bool).scatter_(-1, flat, True)
    return mask[:, :, :num_keys]


def true_top_k(scores: Tensor, eligible: Tensor, top_k: int) -> Tuple[Tensor, Tensor]:
    """The true top-k as ``(indices, valid)``, both ``(Q, H, k)``: key positions (int64) and whether the
    entry is a real eligible key (rows with fewer than ``k`` eligible keys get invalid fillers).

    Args: ``scores`` fp32 ``(H, Q, N)``; ``eligible`` bool ``(Q, N)``.
    """
    masked = scores.masked_fill(~eligible[None], float("-inf")).transpose(0, 1)
    values, indices = masked.topk(min(top_k, scores.shape[-1]), dim=-1)
    return indices, values > float("-inf")


def recall(truth_indices: Tensor, truth_valid: Tensor, selected: Tensor) -> Tensor:
    """fp64 ``(H,)``: per head, the share of true top-k keys that are selected.

    Args: ``truth_indices``/``truth_valid`` ``(Q, H, k)`` from :func:`true_top_k`; ``selected`` bool ``(Q, H, N)``.
    """
    hits = (selected.gather(-1, truth_indices) & truth_valid).sum(dim=(0, 2)).double()
    return hits / truth_valid.sum(dim=(0, 2)).clamp_min(1).double()


def _per_row(signatures: Tensor) -> Tensor:
    """``(1, H, Q, W)`` -> ``(Q, H, 1, W)``: each query row becomes its own batch entry, so every row
    gets its own length (``p + 1``) and budget through the ops' per-sequence tensors."""
    return signatures[0].transpose(0, 1)[:, :, None, :].contiguous()


def lsh_projections(config: TrainConfig, layer: int, heads: int, head_dim: int) -> Tensor:
    """fp32 ``(heads, D, bits)`` Gaussian projections, seeded by (seed, layer)."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + 500_000 + layer)
    return torch.randn(heads, head_dim, config.bits, generator=generator)


def select_by_signatures(query_rows: Tensor, key_rows: Tensor, positions: Tensor, budgets: Tensor,
                         selection_heads: int, config: TrainConfig) -> Tensor:
    """Selection bool ``(Q, Hs, N)`` from per-row signatures ``(Q, Hq, 1, W)`` / ``(Q, Hk, N, W)``."""
    indices, _ = ops.hamming_topk(
        query_rows, key_rows, selection_heads=selection_heads, sink_tokens=config.sink_tokens,
        local_tokens=config.local_tokens, budget_tokens=max(int(budgets.max()), 0),
        lengths=(positions + 1).to(torch.int32), budgets=budgets)
    return selection_mask(indices, key_rows.shape[2])


def select_by_scores(score_rows: Tensor, positions: Tensor, budgets: Tensor, config: TrainConfig) -> Tensor:
    """Selection bool ``(Q, Hs, N)`` from per-row exact scores ``(Q, Hs, 1, N)``."""
    indices, _ = ops.topk_from_scores(
        score_rows, sink_tokens=config.sink_tokens, local_tokens=config.local_tokens,
        budget_tokens=max(int(budgets.max()), 0), lengths=(positions + 1).to(torch.int32), budgets=budgets)
    return selection_mask(indices, score_rows.shape[-1])


def layer_recall(config: TrainConfig, layer_adapter: LayerAdapter, samples: List[Dict[str, Tensor]],
                 layer: int, extra: Optional[Dict[str, LayerAdapter]] = None) -> Dict[str, Dict[str, float]]:
    """``{method: {"<s>x": recall}}`` of one layer over ``samples`` (recall pooled over queries and heads)."""
    adapters = {"learned": layer_adapter, **(extra or {})}
    hits: Dict[str, Dict[int, List[float]]] = {}
    for sample in samples:
        positions, queries, keys = sample["query_positions"], sample["queries"], sample["keys"]
        heads, kv_heads, head_dim = queries.shape[0], keys.shape[0], queries.shape[-1]
        num_keys = keys.shape[1]
        group = heads // kv_heads
        shared = config.key_heads == "kv"
        selection_heads = kv_heads if shared else heads
        scores = target_scores(queries, keys)
        eligible = eligible_keys(positions, num_keys, config.sink_tokens, config.local_tokens)
        truth_indices, truth_valid = true_top_k(scores, eligible, config.top_k)
        # Oracle scores: each head's own q·k, or the group's summed attention probability when shared.
        if shared:
            causal = causal_keys(positions, num_keys)
            probabilities = torch.softmax(scores.masked_fill(~causal[None], float("-inf")), dim=-1)
            oracle_scores = probabilities.unflatten(0, (kv_heads, group)).sum(1)
        else:
            oracle_scores = scores
        oracle_rows = oracle_scores.transpose(0, 1)[:, :, None, :].contiguous()
        projections = lsh_projections(config, layer, kv_heads if shared else heads, head_dim)
        zeros = [torch.zeros(projections.shape[0], config.bits)]
        key_source = keys[None] if shared else keys[None].repeat_interleave(group, dim=1)
        query_projections = projections.repeat_interleave(group, dim=0) if shared else projections
        signatures = {
            name: (adapter.query_signatures(queries[None]), adapter.key_signatures(keys[None]))
            for name, adapter in adapters.items()
        }
        signatures["lsh"] = (
            ops.encode_signatures(queries[None], [query_projections], [torch.zeros(heads, config.bits)]),
            ops.encode_signatures(key_source, [projections], zeros),
        )
        rows = positions.shape[0]
        # Each query row becomes its own batch entry (own length p + 1, own budget); built once per sample.
        signature_rows = {name: (_per_row(q), k.expand(rows, -1, -1, -1).contiguous())
                          for name, (q, k) in signatures.items()}
        for sparsity in config.sparsities:
            budgets = row_budgets(positions, sparsity, config.sink_tokens, config.local_tokens)
            selections = {name: select_by_signatures(q, k, positions, budgets, selection_heads, config)
                          for name, (q, k) in signature_rows.items()}
            selections["oracle"] = select_by_scores(oracle_rows, positions, budgets, config)
            for name, selected in selections.items():
                if shared:
                    selected = selected.repeat_interleave(group, dim=1)
                hits.setdefault(name, {}).setdefault(sparsity, []).append(recall(truth_indices, truth_valid, selected))
    return {name: {f"{s}x": float(torch.stack(v).mean()) for s, v in per_s.items()} for name, per_s in hits.items()}


def validate(config: TrainConfig, context: DistributedContext, adapters_dir: Optional[str] = None) -> Optional[Dict]:
    """Validate this rank's layers; rank 0 writes ``<work_dir>/validation/{recall.json,table.md,*.png}``,
    records the summary in the adapters' ``config.validation`` and returns the report."""
    if config.validation_sequences == 0:
        raise ValueError("TrainConfig.validation_sequences must be >= 1 to validate")
    paths = require_shards(config, "validation")
    adapters_dir = adapters_dir or config.adapters_dir
    adapters = HashAdapters.from_pretrained(adapters_dir, dtype=torch.float32)
    layers = config.selected_layers(adapters.config.num_layers)
    results = {}
    for layer in context.my_share(layers):
        samples = load_layer_samples(paths, layer)
        results[layer] = layer_recall(config, adapters[layer], samples, layer)
        log.info("validate: layer %d %s", layer, json.dumps(results[layer]))
    gathered = {}
    for part in context.gather_objects(results):
        gathered.update(part)
    report = None
    if context.is_main:
        report = summarize(config, {l: gathered[l] for l in sorted(gathered)})
        write_report(config, report)
        adapters.config.validation = {
            "metric": f"recall of the true top-{config.top_k} (q·k/√d, outside sink {config.sink_tokens} / local "
                      f"{config.local_tokens}) within a selection of n/s tokens in total, windows included",
            "validation_sequences": len(paths), "queries_per_sequence": config.queries_per_sequence,
            "mean": report["mean"], "per_layer": report["per_layer"],
        }
        _record_validation(adapters_dir, adapters.config.validation)
        print(report["table"])
    context.barrier()
    return report


def _record_validation(adapters_dir: str, validation: Dict) -> None:
    """Fill ``validation`` into ``adapter_config.json`` in place (the weights file, in its stored dtype, is untouched)."""
    from hashattention.adapters import CONFIG_NAME

    path = os.path.join(adapters_dir, CONFIG_NAME)
    with open(path) as f:
        raw = json.load(f)
    raw["validation"] = validation
    text = json.dumps(raw, indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda p: open(p, "w").write(text))


def summarize(config: TrainConfig, per_layer: Dict[int, Dict[str, Dict[str, float]]]) -> Dict:
    methods = list(next(iter(per_layer.values())).keys())
    budgets = [f"{s}x" for s in config.sparsities]
    mean = {m: {b: sum(per_layer[l][m][b] for l in per_layer) / len(per_layer) for b in budgets} for m in methods}
    lines = ["| selector | " + " | ".join(f"recall@{b} (n/{b[:-1]})" for b in budgets) + " |",
             "|---|" + "---|" * len(budgets)]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(f"{mean[m][b]:.3f}" for b in budgets) + " |")
    return {"mean": mean, "per_layer": {str(l): v for l, v in per_layer.items()}, "table": "\n".join(lines)}


def write_report(config: TrainConfig, report: Dict) -> None:
    directory = os.path.join(config.work_dir, "validation")
    os.makedirs(directory, exist_ok=True)
    text = json.dumps({k: v for k, v in report.items() if k != "table"}, indent=2)
    atomic_write(os.path.join(directory, "recall.json"), lambda p: open(p, "w").write(text + "\n"))
    atomic_write(os.path.join(directory, "table.md"), lambda p: open(p, "w").write(report["table"] + "\n"))
    try:
        plot_report(config, report, directory)
    except ImportError:
        log.warning("validate: matplotlib is not installed, no plots written")


def plot_report(config: TrainConfig, report: Dict, directory: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(int(l) for l in report["per_layer"])
    methods = list(report["mean"].keys())
    budgets = [f"{s}x" for s in config.sparsities]
    fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 4), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        for m in methods:
            ax.plot(layers, [report["per_layer"][str(l)][m][budget] for l in layers], marker="o", ms=3, label=m)
        ax.set(title=f"budget n/{budget[:-1]}", xlabel="layer", ylabel=f"recall of true top-{config.top_k}", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "recall_per_layer.png"), dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 4))
    for m in methods:
        ax.plot(list(config.sparsities), [report["mean"][m][b] for b in budgets], marker="o", label=m)
    ax.set(xscale="log", xlabel="sparsity s (budget n/s)", ylabel=f"mean recall of true top-{config.top_k}", ylim=(0, 1.02))
    ax.set_xticks(list(config.sparsities), [str(s) for s in config.sparsities])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "recall_vs_budget.png"), dpi=100)
    plt.close(fig)
