"""Scale out: layers (and collection sequences) sharded across ``torchrun`` processes.

Layers are independent in the recipe, so process ``rank`` of ``world_size`` trains and validates
layers ``rank, rank + world_size, ...``; collection splits sequences the same way. Processes meet
only at barriers and one gather of validation results (small Python objects).

Where a process computes is ``TrainConfig.device``: ``"cpu"`` (every process on the host's cores;
torch.distributed's ``gloo`` backend) or ``"cuda"`` (process ``LOCAL_RANK`` on GPU ``LOCAL_RANK`` of
its host; ``nccl``, whose collectives run between GPUs and which refuses CPU tensors). The backend
follows the device (:func:`process_group_backend`).

Without torchrun (no ``WORLD_SIZE`` in the environment) everything runs in one process.
"""

from __future__ import annotations

import os
from typing import Any, List, Sequence

import torch
import torch.distributed as dist

from .config import DEVICES


def process_group_backend(device: torch.device) -> str:
    """torch.distributed backend for processes that compute on ``device``: ``"nccl"`` on CUDA, ``"gloo"`` else."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device of the process with ``local_rank`` on its host: the CPU, or its own GPU ``cuda:<local_rank>``.

    Raises:
        ValueError: ``device`` is not one of :data:`DEVICES`; ``"cuda"`` without a CUDA device, or with
            fewer GPUs than the host's processes (``--nproc_per_node`` above the GPU count).
    """
    if device not in DEVICES:
        raise ValueError(f"TrainConfig.device must be one of {DEVICES}, got {device!r}")
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("TrainConfig.device = 'cuda' but torch finds no CUDA device (torch.cuda.is_available() "
                         "is False); use --device cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(f"TrainConfig.device = 'cuda': process LOCAL_RANK = {local_rank} has no GPU of its own, the "
                         f"host has {count}; start at most {count} processes per node (torchrun --nproc_per_node)")
    return torch.device("cuda", local_rank)


class DistributedContext:
    """Rank, world size, this process's device and the few collectives the pipeline needs."""

    def __init__(self, device: str = "cpu"):
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = rank_device(device, self.local_rank)
        self.initialized_here = False
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL's collectives and barriers use the current device
        if self.world_size > 1 and not dist.is_initialized():
            if self.device.type == "cuda":
                dist.init_process_group(backend=process_group_backend(self.device), device_id=self.device)
            else:
                dist.init_process_group(backend=process_group_backend(self.device))
            self.initialized_here = True

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def my_share(self, items: Sequence[Any]) -> List[Any]:
        """Round-robin share of ``items`` for this rank."""
        return list(items)[self.rank :: self.world_size]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def gather_objects(self, obj: Any) -> List[Any]:
        """Every rank's ``obj`` (in rank order) on every rank."""
        if self.world_size == 1:
            return [obj]
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.initialized_here and dist.is_initialized():
            dist.destroy_process_group()
