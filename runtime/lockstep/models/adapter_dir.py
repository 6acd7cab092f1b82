"""LoRA adapter directories in peft's layout: adapter_config.json + adapter_model.safetensors.

Why it exists: one on-disk form of an adapter serves every reader: `PeftModel.from_pretrained(base,
dir)`, SGLang's /load_lora_adapter, the reference engine, and resume. The trainer writes it (its
checkpoints) and the weight sync writes it (the versions engines load from disk), so it lives below
both. Tensor names are peft's saved names (`base_model.model.<module>.lora_A.weight` [r, in],
`.lora_B.weight` [out, r]). Files are written to a temporary name, fsynced and renamed, so a reader
sees an old or a whole new file, never a torn one.

Who calls it: lockstep.train.fsdp (checkpoints), lockstep.weights.adapter (disk loads), tests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.models.st_bytes import fsync_dir, fsync_file

if TYPE_CHECKING:
    import torch

ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""peft's file name of the adapter tensors."""
ADAPTER_CONFIG = "adapter_config.json"
"""peft's file name of the adapter config (LoraConfig)."""


def _durable_replace(tmp: Path, final: Path) -> None:
    fsync_file(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def save_adapter(directory: Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
    """Write an adapter directory (each file durably and atomically); the config last."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{ADAPTER_WEIGHTS}.tmp-{os.getpid()}"
    save_file(
        {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()},
        str(tmp),
        metadata={"format": "pt"},
    )
    _durable_replace(tmp, directory / ADAPTER_WEIGHTS)
    tmp = directory / f".{ADAPTER_CONFIG}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(dict(config), indent=1, sort_keys=True))
    _durable_replace(tmp, directory / ADAPTER_CONFIG)


def load_adapter(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors by saved name, config) of an adapter directory; raises FileNotFoundError naming what lacks."""
    from safetensors.torch import load_file

    directory = Path(directory)
    missing = [f for f in (ADAPTER_WEIGHTS, ADAPTER_CONFIG) if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(f"adapter directory {directory} lacks {', '.join(missing)}")
    config: dict[str, Any] = json.loads((directory / ADAPTER_CONFIG).read_text())
    return dict(load_file(str(directory / ADAPTER_WEIGHTS))), config


def is_adapter_dir(directory: Path) -> bool:
    """Whether `directory` holds an adapter in peft's layout."""
    return (Path(directory) / ADAPTER_CONFIG).is_file()
