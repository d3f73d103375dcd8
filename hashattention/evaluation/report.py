"""Aggregation of per-sample records into tables, JSON and PNG plots.

Numbers per (context, selector, sparsity), averaged over samples:

* ``recall``: recall@k of the true top-k, averaged over sparse rows and heads, per layer
  (``recall_per_layer``) and over layers; ``mass``: likewise for the attention mass;
* ``nll``: mean next-token NLL (nats) of the sparse-decoded tokens; ``delta_nll``: minus the
  full model's on the same tokens;
* ``tasks``: per task, RULER ``string_match_all`` x 100 averaged over samples; ``task_average``:
  their mean over tasks, ``task_average_se`` its standard error over the samples;
  ``task_delta`` / ``task_delta_se``: the task average minus the full model's, over the samples
  both have, and its standard error from the per-sample differences (the same prompts).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

from .metrics import mean_ignoring_none, paired_task_difference, task_average_with_error


def _mean(values: List[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def _layer_mean(vectors: List[List[Optional[float]]]) -> List[Optional[float]]:
    if not vectors:
        return []
    layers = max(len(v) for v in vectors)
    return [mean_ignoring_none([v[l] for v in vectors if l < len(v)]) for l in range(layers)]


def aggregate(evaluation) -> Dict[str, Any]:
    """Results of the current grid from ``evaluation.store`` (an :class:`~.harness.Evaluation`)."""
    cfg = evaluation.config
    levels = {name: ([None] if selector.dense else [float(s) for s in cfg.sparsities])
              for name, selector in evaluation.selectors.items()}
    rows = []
    dense_names = [name for name, selector in evaluation.selectors.items() if selector.dense]

    def task_scores(context, name, sparsity) -> Dict[str, Dict[int, float]]:  # task -> sample -> score x 100
        scores: Dict[str, Dict[int, float]] = {}
        for task in cfg.tasks:
            for index in range(cfg.task_samples):
                record = evaluation.store.get(evaluation.key("task", context, index, name, sparsity, task))
                if record is not None:
                    scores.setdefault(task, {})[index] = 100.0 * record["score"]
        return scores

    for context in cfg.contexts:
        dense_nll = {}
        for name in dense_names[:1]:
            for index in range(cfg.nll_samples):
                record = evaluation.store.get(evaluation.key("nll", context, index, name, None))
                if record is not None:
                    dense_nll[index] = record["nll_sum"] / record["tokens"]
        dense_tasks = task_scores(context, dense_names[0], None) if dense_names else {}
        for name, sparsities in levels.items():
            for sparsity in sparsities:
                nll_records = [evaluation.store.get(evaluation.key("nll", context, index, name, sparsity))
                               for index in range(cfg.nll_samples)]
                nll_records = [r for r in nll_records if r is not None]
                recall_layers = _layer_mean([r["recall_per_layer"] for r in nll_records])
                mass_layers = _layer_mean([r["mass_per_layer"] for r in nll_records])
                nll = _mean([r["nll_sum"] / r["tokens"] for r in nll_records])
                deltas = [r["nll_sum"] / r["tokens"] - dense_nll[r["sample"]] for r in nll_records
                          if r["sample"] in dense_nll]
                by_sample = task_scores(context, name, sparsity)
                per_task = {task: _mean(list(values.values())) for task, values in by_sample.items()}
                complete = len(by_sample) == len(cfg.tasks)
                task_average, task_se = (task_average_with_error({t: list(v.values()) for t, v in by_sample.items()})
                                         if complete else (None, None))
                task_delta, task_delta_se = (paired_task_difference(by_sample, dense_tasks) if complete
                                             else (None, None))
                rows.append({
                    "context": context,
                    "selector": name,
                    "sparsity": sparsity,
                    "recall": mean_ignoring_none(recall_layers),
                    "mass": mean_ignoring_none(mass_layers),
                    "recall_per_layer": recall_layers,
                    "mass_per_layer": mass_layers,
                    "nll": nll,
                    "delta_nll": _mean(deltas),
                    "nll_samples": len(nll_records),
                    "tasks": per_task,
                    "task_average": task_average,
                    "task_average_se": task_se,
                    "task_delta": task_delta,
                    "task_delta_se": task_delta_se,
                    "task_samples": sum(len(values) for values in by_sample.values()),
                })
    selectors = {
        name: {"aux_bits_per_token": selector.aux_bits_per_token(evaluation.shape), "available": True,
               "identity": selector.identity()}
        for name, selector in evaluation.selectors.items()
    }
    for name, reason in evaluation.unavailable.items():
        selectors[name] = {"available": False, "reason": reason}
    return {
        "model": cfg.model_name,
        "shape": vars(evaluation.shape),
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()},
        "selectors": selectors,
        "notes": list(evaluation.notes),
        "rows": rows,
    }


def _fmt(value: Optional[float], digits: int = 3, signed: bool = False) -> str:
    if value is None:
        return "–"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _level(sparsity: Optional[float]) -> str:
    return "dense" if sparsity is None else f"{sparsity:g}x"


def markdown(results: Dict[str, Any]) -> str:
    """The headline table (recall, mass, ΔNLL, task average) and the per-task table, per context."""
    cfg = results["config"]
    selectors = results["selectors"]
    lines = [
        f"Model: {results['model'] or 'unnamed'} · windows: sink {cfg['sink_tokens']} + local {cfg['local_tokens']} · "
        f"recall of the true top-{cfg['top_k']} · NLL over the last {cfg['nll_tokens']} tokens "
        f"({cfg['nll_samples']} sample(s)) · tasks: {cfg['task_samples']} sample(s) each, last "
        f"{cfg['sparse_prompt_tokens']} prompt tokens sparse · seed {cfg['seed']}",
        "",
    ]
    for context in cfg["contexts"]:
        rows = [r for r in results["rows"] if r["context"] == context]
        if not rows:
            continue
        lines += [f"### Context {context} tokens", "",
                  "| selector | aux bits/token/layer | sparsity | recall@{k} | attention mass | ΔNLL (nats) | task avg "
                  "| ± SE | Δ task vs dense | ± SE (paired) |".format(k=cfg["top_k"]),
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            aux = selectors.get(r["selector"], {}).get("aux_bits_per_token")
            aux_text = "–" if aux is None else f"{aux:g}"
            lines.append(f"| {r['selector']} | {aux_text} | {_level(r['sparsity'])} | {_fmt(r['recall'])} | "
                         f"{_fmt(r['mass'])} | {_fmt(r['delta_nll'], signed=True)} | {_fmt(r['task_average'], 1)} | "
                         f"{_fmt(r.get('task_average_se'), 1)} | {_fmt(r.get('task_delta'), 1, signed=True)} | "
                         f"{_fmt(r.get('task_delta_se'), 1)} |")
        lines.append("")
        task_names = [t for t in cfg["tasks"] if any(t in r["tasks"] for r in rows)]
        if task_names:
            lines += ["| selector | sparsity | " + " | ".join(task_names) + " |",
                      "|---|---:|" + "---:|" * len(task_names)]
            for r in rows:
                lines.append(f"| {r['selector']} | {_level(r['sparsity'])} | "
                             + " | ".join(_fmt(r["tasks"].get(t), 1) for t in task_names) + " |")
            lines.append("")
    unavailable = {n: s["reason"] for n, s in selectors.items() if not s["available"]}
    for name, reason in unavailable.items():
        lines.append(f"- `{name}` not evaluated: {reason}")
    for note in results["notes"]:
        if not any(note.endswith(reason) for reason in unavailable.values()):
            lines.append(f"- {note}")
    return "\n".join(lines).rstrip() + "\n"


_MARKERS = "osD^vP*Xh<>p"


def _style(name: str, names: List[str]) -> Dict[str, Any]:
    """The same colour and marker for a selector in every plot (tab20: enough distinct colours)."""
    import matplotlib

    index = names.index(name) if name in names else len(names)
    colour = matplotlib.colormaps["tab20"](index % 20)
    return {"color": colour, "marker": _MARKERS[index % len(_MARKERS)], "label": name}


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")


def plots(results: Dict[str, Any], directory: str) -> List[str]:
    """recall_vs_sparsity.png, task_score_vs_sparsity.png, recall_per_layer.png; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = results["config"]
    contexts = [c for c in cfg["contexts"] if any(r["context"] == c for r in results["rows"])]
    written = []
    if not contexts:
        return written
    sparse_names = list(dict.fromkeys(r["selector"] for r in results["rows"] if r["sparsity"] is not None))

    def by_sparsity(metric: str, filename: str, ylabel: str):
        fig, axes = plt.subplots(1, len(contexts), figsize=(5.5 * len(contexts), 4.2), squeeze=False)
        for ax, context in zip(axes[0], contexts):
            rows = [r for r in results["rows"] if r["context"] == context]
            for name in sparse_names:
                points = sorted((r["sparsity"], r[metric]) for r in rows
                                if r["selector"] == name and r["sparsity"] is not None and r[metric] is not None)
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], **_style(name, sparse_names))
            dense = [r[metric] for r in rows if r["sparsity"] is None and r[metric] is not None]
            if dense:
                ax.axhline(dense[0], color="black", linestyle="--", linewidth=1, label="full (dense)")
            ax.set_xscale("log", base=2)
            ax.set_xticks([float(s) for s in cfg["sparsities"]], [f"{float(s):g}x" for s in cfg["sparsities"]])
            ax.set_title(f"context {context}")
            ax.set_xlabel("sparsity")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        _legend(axes[0][-1])
        fig.tight_layout()
        path = os.path.join(directory, filename)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    by_sparsity("recall", "recall_vs_sparsity.png", f"recall of true top-{cfg['top_k']}")
    if any(r["task_average"] is not None for r in results["rows"]):
        by_sparsity("task_average", "task_score_vs_sparsity.png", "task score (avg, %)")

    measured = sorted({r["sparsity"] for r in results["rows"] if r["sparsity"] is not None and r["recall_per_layer"]})
    if not measured:
        return written
    chosen = 16.0 if 16.0 in measured else measured[len(measured) // 2]
    fig, axes = plt.subplots(1, len(contexts), figsize=(5.5 * len(contexts), 4.2), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        for r in results["rows"]:
            if r["context"] == context and r["sparsity"] == chosen and r["recall_per_layer"]:
                values = r["recall_per_layer"]
                ax.plot(range(len(values)), [float("nan") if v is None else v for v in values], markersize=3,
                        linewidth=1, **_style(r["selector"], sparse_names))
        ax.set_title(f"context {context}, {chosen:g}x")
        ax.set_xlabel("layer")
        ax.set_ylabel(f"recall of true top-{cfg['top_k']}")
        ax.grid(alpha=0.3)
    _legend(axes[0][-1])
    fig.tight_layout()
    path = os.path.join(directory, "recall_per_layer.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def write_report(results: Dict[str, Any], directory: str) -> Dict[str, str]:
    """Write results.json, results.md and the plots into ``directory``; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    paths = {"json": os.path.join(directory, "results.json"), "markdown": os.path.join(directory, "results.md")}
    with open(paths["json"], "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
        f.write("\n")
    with open(paths["markdown"], "w") as f:
        f.write(markdown(results))
    for path in plots(results, directory):
        paths[os.path.splitext(os.path.basename(path))[0]] = path
    return paths
