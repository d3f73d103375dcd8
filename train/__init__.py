"""Adapter training pipeline: collect post-RoPE queries/keys, label, fit, validate (``python -m train --help``).

Modules, one job each: :mod:`train.config` (the recipe), :mod:`train.data` (text -> token sequences),
:mod:`train.model` (frozen model loading), :mod:`train.collect` (capture through the attention
interface -> shards), :mod:`train.labels` (true top-k targets and masks), :mod:`train.fit` (loss, Adam,
resumable per-layer training), :mod:`train.validate` (recall vs LSH and oracle), :mod:`train.checkpoint`
(atomic files), :mod:`train.distributed` (layers sharded across torchrun processes).
"""
