"""Process-group set-up of a trainer backend: torchrun env, or a single in-process rank.

Why it exists: `lockstep run` on a laptop is one process with world size 1 (no ports, no env), while
trainer pods get RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from torchrun. Both end up with an
initialised default process group: gloo on CPU, NCCL on CUDA.

Who calls it: lockstep.train.fsdp.backend and lockstep.train.megatron.parallel (shared here so neither
backend imports the other).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DistInfo:
    """Where this process sits in the trainer's process group."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of ranks."""
    local_rank: int
    """Rank on this host (selects the CUDA device)."""
    owns_group: bool
    """True when this module created the process group (and so destroys it on close)."""


def init_distributed(device_type: str) -> DistInfo:
    """Initialise (or join) the default process group for `device_type` ("cpu" or "cuda")."""
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), False)
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend=backend, init_method="env://")
    else:
        # One process, no env: a HashStore needs no port, so this works in tests and in `lockstep run`.
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1)
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), True)
