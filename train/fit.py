"""Fit each layer's query/key MLPs on the collected shards.

Per layer and step (one training sequence, all heads batched):

    z[h, q, j] = tanh(f_q(q))[h, q] · tanh(f_k(k))[h, j] − threshold
    loss = mean over eligible cells of  −[w₊·y·log σ(z) + (1 − y)·log σ(−z)],   w₊ = alpha + beta·n

with ``y`` the top-k labels of :mod:`train.labels`, ``n = p + 1`` the keys the query at position
``p`` sees, and cells outside the eligible set (sink, local, future keys) excluded from both the sum
and the count. Adam on fp32 parameters. Layers are independent (own seed, own optimizer, own
checkpoint), which is what lets :mod:`train.distributed` shard them.

Resumption is exact: the sequence order of epoch ``e`` is a permutation seeded by
``(seed, layer, e)``, and a checkpoint (written atomically every ``checkpoint_every`` steps) holds
the parameters, the optimizer state and the step, so a resumed run performs the very same
floating-point operations as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from hashattention.adapters import AdapterConfig, HashAdapters, LayerAdapter

from .checkpoint import atomic_write, load_checkpoint, naming_the_file, save_checkpoint
from .collect import require_shards, shard_paths
from .config import TrainConfig, setting_differences
from .distributed import DistributedContext
from .labels import attention_positive_scale, causal_keys, eligible_keys, target_scores, top_k_labels

log = logging.getLogger(__name__)
#: The command line recorded in the adapters' ``config.training`` (set by ``python -m train``).
RUN_COMMAND = ""
#: The settings that decide the fitted weights beyond the shards (which carry their own
#: settings, :data:`train.collect.COLLECTION_FIELDS`): they cannot change once fitting has started.
FIT_FIELDS = ("train_sequences", "top_k", "sink_tokens", "local_tokens", "target", "key_heads", "bits",
              "hidden_features", "activation", "alpha", "beta", "positive_attention_mix", "threshold",
              "learning_rate", "epochs", "seed")
#: The settings that may change between a fit and its ``--resume``: which layers this run fits,
#: how it runs, what validation measures, where the adapters are written and in which dtype.
#: (Resumed weights are bit-identical for any ``checkpoint_every``.)
RESUMABLE_FIELDS = ("layers", "threads", "device", "checkpoint_every", "validation_sequences", "sparsities",
                    "save_dtype", "work_dir", "output_dir")


def weighted_bce_loss(logits: Tensor, labels: Tensor, included: Tensor, positive_weight: Tensor,
                      positive_scale: Optional[Tensor] = None) -> Tensor:
    """Mean positive-weighted BCE-with-logits over the included cells.

    Args:
        logits: ``(H, Q, N)``; labels: bool ``(H, Q, N)``; included: bool ``(Q, N)`` (shared by heads);
        positive_weight: ``(Q,)`` weight of a positive cell in each query row.
        positive_scale: optional ``(H, Q, N)`` per-cell multiplier of the positive weight
            (``labels.attention_positive_scale``).
    """
    count = included.sum() * logits.shape[0]
    if count == 0:
        raise ValueError("no included cells: every key is in a window or in the future")
    # −log σ(z) = softplus(−z), −log(1 − σ(z)) = softplus(z); `where` keeps excluded cells (and
    # their gradients) at exactly zero and costs fewer passes over the (H, Q, N) cells than products.
    weight = positive_weight[None, :, None]
    if positive_scale is not None:
        weight = weight * positive_scale.to(logits.dtype)
    per_cell = torch.where(labels, weight * F.softplus(-logits), F.softplus(logits))
    per_cell = torch.where(included[None], per_cell, torch.zeros((), dtype=logits.dtype))
    return per_cell.sum() / count


def signature_logits(layer: LayerAdapter, queries: Tensor, keys: Tensor, threshold: float) -> Tensor:
    """``(Hq, Q, N)`` = tanh(f_q(q)) · tanh(f_k(k)) − threshold, from queries ``(Hq, Q, D)`` and keys ``(Hkv, N, D)``."""
    query_codes = torch.tanh(layer.query(queries[None].float()))[0]
    key_codes = torch.tanh(layer.key(layer.expand_keys(keys[None].float())))[0]
    heads = query_codes.shape[0]
    if key_codes.shape[0] != heads:  # group-shared key MLPs: each KV head serves its group of query heads
        key_codes = key_codes.repeat_interleave(heads // key_codes.shape[0], dim=0)
    return torch.matmul(query_codes, key_codes.transpose(1, 2)) - threshold


def add_labels(config: TrainConfig, sample: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """Add ``labels`` bool ``(Hq, Q, N')`` and ``eligible`` bool ``(Q, N')`` to a sample, computed once
    (they do not change during training); keys are cut to ``N' = max position + 1``, since later
    keys are in every sampled query's future."""
    positions = sample["query_positions"]
    num_keys = int(positions.max()) + 1
    keys = sample["keys"][:, :num_keys]
    queries = sample["queries"]
    group = queries.shape[0] // keys.shape[0] if config.key_heads == "kv" else 1
    scores = target_scores(queries, keys, sample["value_norms"][:, :num_keys], config.target)
    eligible = eligible_keys(positions, num_keys, config.sink_tokens, config.local_tokens)
    weighted = config.positive_attention_mix > 0
    causal = causal_keys(positions, num_keys) if group > 1 or weighted else None
    labels = top_k_labels(scores, eligible, config.top_k, group, causal)
    extra = {}
    if weighted:
        extra["positive_scale"] = attention_positive_scale(scores, labels, causal, config.positive_attention_mix)
    return {**sample, "keys": keys, "labels": labels, "eligible": eligible, **extra}


def sequence_loss(layer: LayerAdapter, config: TrainConfig, sample: Dict[str, Tensor]) -> Tensor:
    """The loss of one layer on one collected sequence (``sample`` as returned by :func:`add_labels`)."""
    if "labels" not in sample:
        sample = add_labels(config, sample)
    logits = signature_logits(layer, sample["queries"], sample["keys"], config.threshold)
    positive_weight = config.alpha + config.beta * (sample["query_positions"] + 1).to(logits.dtype)
    return weighted_bce_loss(logits, sample["labels"], sample["eligible"], positive_weight,
                             sample.get("positive_scale"))


def load_layer_samples(paths: List[str], layer: int) -> List[Dict[str, Tensor]]:
    """One dict per shard with ``query_positions``, ``queries``, ``keys``, ``value_norms`` of ``layer``."""
    from safetensors import safe_open

    samples = []
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: run `python -m train collect` first")
        with naming_the_file(path, "shard", "delete it and run `python -m train collect` again"):
            with safe_open(path, framework="pt") as f:
                samples.append({
                    "query_positions": f.get_tensor("query_positions"),
                    "queries": f.get_tensor(f"layer.{layer}.queries").float(),
                    "keys": f.get_tensor(f"layer.{layer}.keys").float(),
                    "value_norms": f.get_tensor(f"layer.{layer}.value_norms").float(),
                })
    return samples


def adapter_config(config: TrainConfig, model_config: Dict) -> AdapterConfig:
    return AdapterConfig(
        num_layers=model_config["num_layers"], num_query_heads=model_config["num_query_heads"],
        num_kv_heads=model_config["num_kv_heads"], head_dim=model_config["head_dim"], key_heads=config.key_heads,
        bits=config.bits, hidden_features=config.hidden_features, activation=config.activation,
        model=model_config.get("model", ""),
    )


def model_layout_from_shard(path: str, model_name: str) -> Dict:
    """Head layout read from a shard (so fitting never needs the model)."""
    from safetensors import safe_open

    with naming_the_file(path, "shard", "delete it and run `python -m train collect` again"), \
            safe_open(path, framework="pt") as f:
        names = list(f.keys())
        layers = sorted({int(n.split(".")[1]) for n in names if n.startswith("layer.")})
        queries = f.get_slice("layer.0.queries").get_shape()
        keys = f.get_slice("layer.0.keys").get_shape()
    return {"num_layers": len(layers), "num_query_heads": queries[0], "num_kv_heads": keys[0],
            "head_dim": queries[2], "model": model_name}


def checkpoint_path(config: TrainConfig, layer: int) -> str:
    return os.path.join(config.work_dir, "checkpoints", f"layer{layer:03d}.pt")


def final_layer_path(config: TrainConfig, layer: int) -> str:
    return os.path.join(config.work_dir, "layers", f"layer{layer:03d}.safetensors")


def epoch_order(config: TrainConfig, layer: int, epoch: int, count: int) -> Tensor:
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + layer * 1_009 + epoch)
    return torch.randperm(count, generator=generator)


def fit_layer(config: TrainConfig, layout: Dict, layer: int, resume: bool, progress: Optional[tqdm] = None,
              step_budget: Optional[List[int]] = None, device: torch.device = torch.device("cpu")) -> Optional[Dict]:
    """Train one layer on ``device`` to the end (or until ``step_budget[0]`` steps ran); returns its summary
    when finished. Checkpoints and the layer's weights are read and written from and to CPU tensors."""
    from safetensors.torch import save_file

    final_path = final_layer_path(config, layer)
    ckpt_path = checkpoint_path(config, layer)
    samples = [add_labels(config, {name: t.to(device) for name, t in s.items()})
               for s in load_layer_samples(shard_paths(config, "train"), layer)]
    steps_per_epoch = len(samples)
    total_steps = config.epochs * steps_per_epoch
    torch.manual_seed(config.seed * 1_000_003 + layer)
    module = LayerAdapter(adapter_config(config, layout)).to(device)  # initialised on the CPU: same on every device
    optimizer = torch.optim.Adam(module.parameters(), lr=config.learning_rate)
    step, history = 0, []
    state = load_checkpoint(ckpt_path)
    if state is not None:
        if not resume:
            raise ValueError(f"{ckpt_path} exists: pass --resume to continue it, or use a fresh --work-dir")
        module.load_state_dict(state["module"])
        optimizer.load_state_dict(state["optimizer"])
        step, history = int(state["step"]), list(state["history"])
        log.info("fit: layer %d resumes at step %d/%d", layer, step, total_steps)
    if progress is not None:
        progress.update(step)
    order, order_epoch = None, -1
    while step < total_steps:
        if step_budget is not None and step_budget[0] <= 0:
            return None
        epoch, index = divmod(step, steps_per_epoch)
        if epoch != order_epoch:
            order, order_epoch = epoch_order(config, layer, epoch, steps_per_epoch), epoch
        loss = sequence_loss(module, config, samples[int(order[index])])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        history.append(loss.item())
        if step_budget is not None:
            step_budget[0] -= 1
        if progress is not None:
            progress.update(1)
            progress.set_postfix(layer=layer, loss=f"{history[-1]:.4f}")
        if step % config.checkpoint_every == 0 or step == total_steps or (step_budget is not None and step_budget[0] <= 0):
            save_checkpoint(ckpt_path, {"module": module.state_dict(), "optimizer": optimizer.state_dict(),
                                        "step": step, "history": history})  # load_checkpoint maps to the CPU
        if step % steps_per_epoch == 0:
            recent = history[-steps_per_epoch:]
            log.info("fit: layer %d epoch %d mean loss %.5f", layer, step // steps_per_epoch, sum(recent) / len(recent))
    tensors = {name: t.detach().cpu().contiguous() for name, t in module.state_dict().items()}
    atomic_write(final_path, lambda p: save_file(tensors, p))
    epoch_means = [sum(history[i:i + steps_per_epoch]) / steps_per_epoch
                   for i in range(0, len(history), steps_per_epoch)]
    return {"layer": layer, "steps": total_steps, "epoch_mean_loss": epoch_means}


def fit(config: TrainConfig, context: DistributedContext, resume: bool = False,
        stop_after_steps: int = 0) -> Optional[str]:
    """Fit this rank's layers; then rank 0 assembles all layers into ``config.adapters_dir``.

    ``stop_after_steps > 0`` stops this process after that many optimizer steps (after a
    checkpoint): a time-boxed run, continued later with ``resume=True``. Returns the adapters
    directory when it was written, else None.
    """
    if config.train_sequences == 0:
        raise ValueError("TrainConfig.train_sequences must be >= 1 to fit")
    train_paths = require_shards(config, "train")
    layout = model_layout_from_shard(train_paths[0], _model_name(config))
    layers = config.selected_layers(layout["num_layers"])
    check_fit_settings(config, layout["num_layers"], context)
    mine = [l for l in context.my_share(layers) if not os.path.exists(final_layer_path(config, l))]
    budget = [stop_after_steps] if stop_after_steps > 0 else None
    total = len(mine) * config.epochs * len(train_paths)
    summaries = {}
    with tqdm(total=total, desc=f"fit[rank {context.rank}]", disable=not context.is_main) as progress:
        for layer in mine:
            summary = fit_layer(config, layout, layer, resume, progress, budget, device=context.device)
            if summary is None:
                log.info("fit: stopped after %d steps as asked; continue with --resume", stop_after_steps)
                break
            summaries[layer] = summary
    _write_summaries(config, summaries)
    context.barrier()
    if not all(os.path.exists(final_layer_path(config, l)) for l in layers):
        return None
    if context.is_main:
        assemble(config, layout, layers)
    context.barrier()
    return config.adapters_dir


def fit_settings_path(config: TrainConfig) -> str:
    return os.path.join(config.work_dir, "fit_settings.json")


def check_fit_settings(config: TrainConfig, num_layers: int, context: DistributedContext) -> None:
    """Refuse to continue (``--resume``) or reuse the training state of ``config.work_dir`` (layer
    checkpoints, finished layers) with other :data:`FIT_FIELDS` than it was fitted with: the run would
    go on with the checkpoint's optimizer and step count while the adapters recorded the new values.
    The settings are recorded in ``fit_settings.json`` when no training state exists yet."""
    path = fit_settings_path(config)
    current = {name: getattr(config, name) for name in FIT_FIELDS}
    state = [p for layer in range(num_layers) for p in (checkpoint_path(config, layer), final_layer_path(config, layer))
             if os.path.exists(p)]
    if state and os.path.exists(path):
        with open(path) as f:
            differences = setting_differences(json.load(f), current, "checkpoint", "now")
        if differences:
            raise ValueError(
                f"the training state in {config.work_dir} was fitted with other settings: " + "; ".join(differences)
                + ". These cannot change on --resume (only " + ", ".join(RESUMABLE_FIELDS) + " can): pass the "
                "checkpoint's values, or fit into another --work-dir (copy its shards/ to reuse them)")
    elif state:
        log.warning("fit: %s holds training state but no %s; its settings are taken to be the current ones",
                    config.work_dir, os.path.basename(path))
    context.barrier()  # every rank has compared before rank 0 writes
    if context.is_main and (not state or not os.path.exists(path)):
        atomic_write(path, lambda p: open(p, "w").write(json.dumps(current, indent=2) + "\n"))
    context.barrier()


def _model_name(config: TrainConfig) -> str:
    if config.model == "smollm2":
        from hashattention.offline_model import MODEL_NAME

        return MODEL_NAME
    return config.model


def _write_summaries(config: TrainConfig, summaries: Dict[int, Dict]) -> None:
    for layer, summary in summaries.items():
        path = os.path.join(config.work_dir, "layers", f"layer{layer:03d}.json")
        atomic_write(path, lambda p: open(p, "w").write(json.dumps(summary) + "\n"))


def assemble(config: TrainConfig, layout: Dict, layers: List[int]) -> None:
    """Gather the per-layer weights into one ``HashAdapters.save_pretrained`` directory (untrained
    layers, if ``config.layers`` restricted training, keep their seeded initialisation)."""
    from safetensors.torch import load_file

    adapters = HashAdapters(adapter_config(config, layout))
    for layer in layers:
        with naming_the_file(final_layer_path(config, layer), "fitted layer", "delete it and fit it again with --resume"):
            weights = load_file(final_layer_path(config, layer))
        adapters[layer].load_state_dict(weights)
    adapters.config.training = {
        "command": RUN_COMMAND,
        "recipe": config.to_dict(),
        "trained_layers": layers,
        "loss": "positive-weighted BCE on sigmoid(tanh(f_q(q))·tanh(f_k(k)) − threshold), eligible cells only",
        "optimizer": "Adam, fp32 parameters",
    }
    adapters.to(getattr(torch, config.save_dtype)).save_pretrained(config.adapters_dir)
    log.info("fit: wrote %s (%s)", config.adapters_dir, config.save_dtype)
