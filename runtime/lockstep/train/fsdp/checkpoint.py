"""HF-layout checkpoints of the FSDP2 backend, with what resume needs beside the weights.

Why it exists: a checkpoint must be loadable by anything that reads HF checkpoints (the engine's
update_weights_from_disk, transformers' from_pretrained) and must also restore training exactly:
optimizer state, step and RNG. Layout of a checkpoint directory:

    config.json            the model's HF config
    model.safetensors      full (gathered) weights in HF names; a tied lm_head is omitted, as in HF
    optimizer.pt           full (gathered) AdamW state keyed by parameter name (rank 0 writes)
    rng_rank{R}.pt         each rank's torch RNG state (and CUDA RNG when present)
    trainer_state.json     {"step": ..., "extra": {...}} (the driver's resume data lives in extra)

Every file is written durably (temp name, fsync, rename: lockstep.train.common.durable) and read
back with torch.load(weights_only=True): a checkpoint holds tensors and plain data, never code.

Who calls it: lockstep.train.fsdp.backend (save / load).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lockstep.train.common.durable import atomic_path, atomic_write_text, join_checkpoint_dir

if TYPE_CHECKING:
    import torch

WEIGHTS = "model.safetensors"
"""File name of the gathered weights."""
STATE = "trainer_state.json"
"""File name of step and extra resume data."""


class Checkpointed(Protocol):
    """What save and load read and restore of lockstep.train.fsdp.backend.FSDPBackend (declared here so
    this module does not import the backend that calls it)."""

    model: Any
    optimizer: Any
    device: torch.device
    rank: int
    step: int

    @property
    def device_type(self) -> str: ...

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def has_weights(path: Path) -> bool:
    """True when `path` holds safetensors weights (otherwise the model is randomly initialised)."""
    return Path(path).is_dir() and any(Path(path).glob("*.safetensors"))


def save(backend: Checkpointed, directory: Path, extra: dict[str, Any]) -> None:
    """Write the checkpoint; all ranks must call it (gathers are collective)."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    join_checkpoint_dir(directory, backend.rank)  # rank 0 prepared it before anyone writes
    weights = {name: t.to("cpu").contiguous() for name, t in backend.export_weights()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optim_state = get_optimizer_state_dict(backend.model, backend.optimizer, options=options)
    rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if backend.device_type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(backend.device)
    with atomic_path(directory / f"rng_rank{backend.rank}.pt") as tmp:
        torch.save(rng, tmp)
    if backend.rank == 0:
        with atomic_path(directory / WEIGHTS) as tmp:
            save_file(weights, str(tmp), metadata={"format": "pt"})
        atomic_write_text(directory / "config.json", backend.model.config.to_json_string())
        with atomic_path(directory / "optimizer.pt") as tmp:
            torch.save(optim_state, tmp)
        atomic_write_text(directory / STATE, json.dumps({"step": backend.step, "extra": extra}, indent=1))
    dist.barrier()


def load(backend: Checkpointed, directory: Path) -> dict[str, Any]:
    """Restore weights, optimizer, step and RNG written by `save`; returns the saved `extra`."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    missing = [f for f in (WEIGHTS, "optimizer.pt", STATE) if not (directory / f).exists()]
    if missing:
        raise FileNotFoundError(f"checkpoint {directory} is incomplete: missing {', '.join(missing)}")
    options = StateDictOptions(full_state_dict=True, strict=False)
    weights: dict[str, Any] = dict(load_file(str(directory / WEIGHTS)))
    set_model_state_dict(backend.model, weights, options=options)
    optim_state = torch.load(directory / "optimizer.pt", weights_only=True)
    set_optimizer_state_dict(backend.model, backend.optimizer, optim_state_dict=optim_state, options=options)
    rng_file = directory / f"rng_rank{backend.rank}.pt"
    if rng_file.exists():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and backend.device_type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], backend.device)
    state = json.loads((directory / STATE).read_text())
    backend.step = int(state["step"])
    extra: dict[str, Any] = state.get("extra", {})
    return extra
