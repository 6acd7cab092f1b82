"""HF-layout checkpoints of the FSDP2 backend, with what resume needs beside the weights.

Why it exists: a checkpoint must be loadable by anything that reads HF checkpoints (the engine's
update_weights_from_disk, transformers' from_pretrained) and must also restore training exactly:
optimizer state, step and RNG. Layout of a checkpoint directory:

    config.json            the model's HF config
    model.safetensors      full weights in HF names; a tied lm_head is omitted, as in HF
    optimizer.safetensors  AdamW's exp_avg / exp_avg_sq as `<param>.exp_avg` ... (full tensors)
    optimizer.json         AdamW's step counters and hyper-parameters
    rng_rank{R}.pt         each rank's torch RNG state (and CUDA RNG when present)
    trainer_state.json     {"step": ..., "extra": {...}} (the driver's resume data lives in extra)

The tensors are written by every rank at once, each its own rows (lockstep.train.fsdp.sharded_save),
and read back the same way (sharded_load): no rank holds more than its shards. Checkpoints from
before hold a gathered optimizer.pt instead of the two optimizer files; they still load.

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
from lockstep.train.fsdp import sharded_load, sharded_save

if TYPE_CHECKING:
    import torch

WEIGHTS = "model.safetensors"
"""File name of the gathered weights."""
STATE = "trainer_state.json"
"""File name of step and extra resume data."""
LEGACY_OPTIMIZER = "optimizer.pt"
"""The gathered AdamW state of checkpoints written before the streamed save (still read)."""


class Checkpointed(Protocol):
    """What save and load read and restore of lockstep.train.fsdp.backend.FSDPBackend (declared here so
    this module does not import the backend that calls it)."""

    model: Any
    optimizer: Any
    device: torch.device
    rank: int
    step: int

    @property
    def load_bucket_bytes(self) -> int: ...

    @property
    def device_type(self) -> str: ...

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def has_weights(path: Path) -> bool:
    """True when `path` holds safetensors weights (otherwise the model is randomly initialised)."""
    return Path(path).is_dir() and any(Path(path).glob("*.safetensors"))


def save(backend: Checkpointed, directory: Path, extra: dict[str, Any]) -> None:
    """Write the checkpoint; all ranks must call it (gathers are collective)."""
    import torch.distributed as dist

    join_checkpoint_dir(directory, backend.rank)  # rank 0 prepared it before anyone writes
    tied = bool(getattr(backend.model.config, "tie_word_embeddings", False))
    # Each rank writes its own rows of every tensor (sharded_save): nothing is gathered in one host.
    weights = sharded_save.weights_of(backend.model, lambda n: tied and n == "lm_head.weight")
    sharded_save.write_sharded(weights, directory / WEIGHTS, backend.rank)
    sharded_save.save_optimizer(backend.model, backend.optimizer, directory, backend.rank)
    save_rng(backend, directory)
    if backend.rank == 0:
        atomic_write_text(directory / "config.json", backend.model.config.to_json_string())
        atomic_write_text(directory / STATE, json.dumps({"step": backend.step, "extra": extra}, indent=1))
    dist.barrier()


def load(backend: Checkpointed, directory: Path) -> dict[str, Any]:
    """Restore weights, optimizer, step and RNG written by `save`; returns the saved `extra`."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    streamed = (directory / sharded_save.OPTIMIZER_META).exists()
    optimizer = sharded_save.OPTIMIZER_META if streamed else LEGACY_OPTIMIZER
    missing = [f for f in (WEIGHTS, optimizer, STATE) if not (directory / f).exists()]
    if missing:
        raise FileNotFoundError(f"checkpoint {directory} is incomplete: missing {', '.join(missing)}")
    # FSDP2 leaves the root module's parameters unsharded after a forward without a backward (the
    # pre-flight's logprob probe); reading shards into them would mix plain tensors and DTensors
    reshard = getattr(backend.model, "reshard", None)
    if reshard is not None:
        reshard()
    reader = sharded_load.ShardReader(directory, backend.load_bucket_bytes)
    try:  # every rank reads its own rows (a tied lm_head through the embedding)
        sharded_load.load_shards(backend.model, reader)
    finally:
        reader.close()
    if streamed:
        sharded_save.load_optimizer(backend.model, backend.optimizer, directory, backend.load_bucket_bytes)
    else:  # a checkpoint written before the streamed save: the gathered optimizer.pt
        options = StateDictOptions(full_state_dict=True, strict=False)
        optim_state = torch.load(directory / LEGACY_OPTIMIZER, weights_only=True)
        set_optimizer_state_dict(
            backend.model, backend.optimizer, optim_state_dict=optim_state, options=options
        )
    return restore_rng_and_step(backend, directory)


def save_rng(backend: Checkpointed, directory: Path) -> None:
    """Write this rank's RNG states (CPU, and CUDA on a GPU) as rng_rank<R>.pt."""
    import torch

    rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if backend.device_type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(backend.device)
    with atomic_path(directory / f"rng_rank{backend.rank}.pt") as tmp:
        torch.save(rng, tmp)


def restore_rng_and_step(backend: Checkpointed, directory: Path) -> dict[str, Any]:
    """Set this rank's RNG states (when saved) and the backend's step from a checkpoint; its `extra`."""
    import torch

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
