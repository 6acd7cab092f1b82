"""Checkpoints of a LoRA policy: the adapter in peft's layout plus the adapter's optimizer state.

Why it exists: with spec.model.lora the base weights never change, so a checkpoint holds only what
does. Layout of a checkpoint directory (every file durable, as lockstep.train.fsdp.checkpoint's):

    adapter_config.json          peft's LoraConfig (base_model_name_or_path: the base checkpoint)
    adapter_model.safetensors    the adapter's full tensors under peft's saved names
    optimizer.pt                 AdamW state of the adapter parameters only (the base has none)
    rng_rank{R}.pt               each rank's torch RNG state
    trainer_state.json           {"step": ..., "extra": {...}, "lora": true}

`PeftModel.from_pretrained(base, dir)` and SGLang's /load_lora_adapter load the directory as it is;
resume restores adapter, optimizer, step and RNG on every rank and leaves the base untouched.

Who calls it: lockstep.train.fsdp.backend (save / load when its config has an adapter).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lockstep.train.common.durable import atomic_path, atomic_write_text, join_checkpoint_dir
from lockstep.train.fsdp import lora
from lockstep.train.fsdp.checkpoint import STATE, Checkpointed, restore_rng_and_step, save_rng

OPTIMIZER = "optimizer.pt"


def save(backend: Checkpointed, directory: Path, extra: dict[str, Any], config: dict[str, Any]) -> None:
    """Write the adapter checkpoint; all ranks must call it (the gathers are collective)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    join_checkpoint_dir(directory, backend.rank)
    tensors = {name: t.to("cpu") for name, t in backend.export_weights()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optim_state = get_optimizer_state_dict(backend.model, backend.optimizer, options=options)
    save_rng(backend, directory)
    if backend.rank == 0:
        lora.save_adapter(directory, tensors, config)
        with atomic_path(directory / OPTIMIZER) as tmp:
            torch.save(optim_state, tmp)
        state = {"step": backend.step, "extra": extra, "lora": True}
        atomic_write_text(directory / STATE, json.dumps(state, indent=1))
    dist.barrier()


def load_into(model: Any, directory: Path) -> None:
    """Set the adapter tensors of `model` (a sharded or plain peft model) from an adapter directory;
    raises ValueError naming the tensors the directory lacks or has in another shape."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    tensors, _ = lora.load_adapter(directory)
    have = {k: v for k, v in model.state_dict().items() if lora.is_adapter_key(k)}
    wanted: dict[str, Any] = {lora.model_key(n): t for n, t in tensors.items()}
    missing = sorted(set(have) - set(wanted))
    unknown = sorted(set(wanted) - set(have))
    if missing or unknown:
        raise ValueError(
            f"adapter {directory} does not fit the model's adapter (spec.model.lora): missing "
            f"{[lora.saved_name(k) for k in missing[:4]]}, unknown {[lora.saved_name(k) for k in unknown[:4]]}"
        )
    for key, t in wanted.items():
        if tuple(t.shape) != tuple(have[key].shape):
            raise ValueError(
                f"adapter {directory}: {lora.saved_name(key)} has shape {tuple(t.shape)}, the model's is "
                f"{tuple(have[key].shape)} (another spec.model.lora.rank?)"
            )
    set_model_state_dict(model, wanted, options=StateDictOptions(full_state_dict=True, strict=False))


def load(backend: Checkpointed, directory: Path) -> dict[str, Any]:
    """Restore adapter, optimizer, step and RNG written by `save`; returns the saved `extra`."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    missing = [f for f in (lora.ADAPTER_WEIGHTS, OPTIMIZER, STATE) if not (directory / f).exists()]
    if missing:
        raise FileNotFoundError(f"LoRA checkpoint {directory} is incomplete: missing {', '.join(missing)}")
    load_into(backend.model, directory)
    optim_state = torch.load(directory / OPTIMIZER, weights_only=True)
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_optimizer_state_dict(backend.model, backend.optimizer, optim_state_dict=optim_state, options=options)
    return restore_rng_and_step(backend, directory)
