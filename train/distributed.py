"""Scale out: layers (and collection sequences) sharded across ``torchrun`` processes.

Layers are independent in the recipe, so process ``rank`` of ``world_size`` trains and validates
layers ``rank, rank + world_size, ...``; collection splits sequences the same way. Processes meet
only at barriers and one gather of validation results, through torch.distributed's ``gloo``
backend (CPU; works on GPU hosts too since only small Python objects travel).

Without torchrun (no ``WORLD_SIZE`` in the environment) everything runs in one process.
"""

from __future__ import annotations

import os
from typing import Any, List, Sequence

import torch.distributed as dist


class DistributedContext:
    """Rank, world size and the few collectives the pipeline needs."""

    def __init__(self):
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.initialized_here = False
        if self.world_size > 1 and not dist.is_initialized():
            dist.init_process_group(backend="gloo")
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
