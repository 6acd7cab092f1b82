"""Checkpoints of the Megatron backend: HF-layout weights plus each rank's optimizer shard.

Why it exists: a checkpoint must load in anything that reads HF checkpoints (the engines,
transformers) and must restore training exactly. The weights are the gathered export in HF names
(the same bytes the engines receive); the optimizer state is the distributed optimizer's shard of each
rank (fp32 master weights and Adam moments, streamed moments read from their files), so resuming
needs the same world size and parallel layout (§7.1 says the same of Miles) and says so when it
differs. Layout of a checkpoint directory:

    config.json              the model's HF config (copied from the initial checkpoint)
    model.safetensors        gathered weights in HF names; a tied lm_head is omitted, as in HF
    optimizer_rank{R}.pt     rank R's master weights, moments, Adam steps and the layout they belong to
    rng_rank{R}.pt           each rank's torch and CUDA RNG state
    trainer_state.json       {"step": ..., "extra": {...}} (the driver's resume data lives in extra)

Every file is written durably (temp name, fsync, rename: lockstep.train.common.durable) and read
back with torch.load(weights_only=True).

Who calls it: lockstep.train.megatron.backend (save / load).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lockstep.train.common.durable import atomic_path, atomic_write_text, join_checkpoint_dir
from lockstep.train.megatron.model import load_into, local_weights
from lockstep.train.megatron.state import MOMENTS, optimizer_params, resident

if TYPE_CHECKING:
    import torch


class Checkpointed(Protocol):
    """What save and load read and restore of lockstep.train.megatron.backend.MegatronBackend (declared
    here so this module does not import the backend that calls it)."""

    bare: Any
    config: Any
    device: torch.device
    groups: Any
    optimizer: Any
    rank: int
    shape: Any
    step: int
    streamed: Any
    world_size: int

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...


WEIGHTS = "model.safetensors"
STATE = "trainer_state.json"


def save(backend: Checkpointed, directory: Path, extra: dict[str, Any]) -> None:
    """Write the checkpoint; every rank calls it (the weight gathers are collective)."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    join_checkpoint_dir(directory, backend.rank)  # rank 0 prepared it before anyone writes
    weights = {name: t.to("cpu").contiguous() for name, t in backend.export_weights()}
    with atomic_path(directory / f"optimizer_rank{backend.rank}.pt") as tmp:
        torch.save(_optimizer_shard(backend), tmp)
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(backend.device)}
    with atomic_path(directory / f"rng_rank{backend.rank}.pt") as tmp:
        torch.save(rng, tmp)
    if backend.rank == 0:
        with atomic_path(directory / WEIGHTS) as tmp:
            save_file(weights, str(tmp), metadata={"format": "pt"})
        with atomic_path(directory / "config.json") as tmp:
            shutil.copyfile(backend.config.checkpoint() / "config.json", tmp)
        atomic_write_text(directory / STATE, json.dumps({"step": backend.step, "extra": extra}, indent=1))
    dist.barrier()


def _layout(backend: Checkpointed) -> dict[str, Any]:
    p = backend.config.parallelism
    return {
        "world_size": backend.world_size,
        "tensor": p.tensor,
        "pipeline": p.pipeline,
        "expert": p.expert,
        "expert_tensor": p.expert_tensor,
    }


def _optimizer_shard(backend: Checkpointed) -> dict[str, Any]:
    """This rank's master weights and moments as CPU tensors (streamed moments read from disk)."""
    tensors: dict[str, Any] = {}
    steps: dict[str, Any] = {}
    for key, inner, p in optimizer_params(backend.optimizer):
        tensors[f"{key}.param"] = p.detach().cpu()
        state = inner.state.get(p, {})
        if "step" in state:
            steps[key] = state["step"]
        for name in MOMENTS:
            if name in state:
                tensors[f"{key}.{name}"] = _read(backend, inner, p, name, state[name])
    return {"layout": _layout(backend), "tensors": tensors, "steps": steps}


def _read(backend: Checkpointed, inner: Any, p: Any, name: str, t: Any) -> Any:
    streamed = backend.streamed
    if streamed is not None and not resident(t):
        return streamed.read(streamed.key_of(inner, p, name), t)
    return t.detach().cpu()


def load(backend: Checkpointed, directory: Path) -> dict[str, Any]:
    """Restore weights, optimizer shard, step and RNG written by `save`; returns the saved `extra`."""
    import torch

    shard_file = directory / f"optimizer_rank{backend.rank}.pt"
    missing = [f.name for f in (directory / WEIGHTS, directory / STATE, shard_file) if not f.exists()]
    if missing:
        raise FileNotFoundError(f"checkpoint {directory} is incomplete: missing {', '.join(missing)}")
    shard = torch.load(shard_file, weights_only=True)
    if shard["layout"] != _layout(backend):
        raise ValueError(
            f"checkpoint {directory} was written by a trainer of layout {shard['layout']}; this one is "
            f"{_layout(backend)}: resume with the same trainer.nodes x gpusPerNode and trainer.parallelism"
        )
    load_into(backend.bare, local_weights(backend.shape, directory, backend.groups.spec))
    _restore_optimizer(backend, shard)
    rng_file = directory / f"rng_rank{backend.rank}.pt"
    if rng_file.exists():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        torch.cuda.set_rng_state(rng["cuda"], backend.device)
    state = json.loads((directory / STATE).read_text())
    backend.step = int(state["step"])
    extra: dict[str, Any] = state.get("extra", {})
    return extra


def _restore_optimizer(backend: Checkpointed, shard: dict[str, Any]) -> None:
    import torch

    tensors, steps = shard["tensors"], shard["steps"]
    for key, inner, p in optimizer_params(backend.optimizer):
        with torch.no_grad():
            p.copy_(tensors[f"{key}.param"].to(p.device))
        if key not in steps:
            continue
        state = inner.state.setdefault(p, {})
        state["step"] = steps[key].clone() if hasattr(steps[key], "clone") else steps[key]
        for name in MOMENTS:
            value = tensors[f"{key}.{name}"]
            if name not in state:
                state[name] = torch.empty_like(p)
            if backend.streamed is not None:
                backend.streamed.write(backend.streamed.key_of(inner, p, name), state[name], value)
            else:
                state[name].copy_(value.to(p.device))
