"""From-disk weight transport: write a full HF checkpoint per version, engines reload it.

Why it exists: the simplest transport that works everywhere the trainer and the engines share a
file system (one machine, a shared volume): each version is a complete HF-layout checkpoint directory
`ROOT/weight_vNNNNNN/` (model.safetensors + config.json + whatever `extra_files` names, e.g. the
tokenizer), written to a temp dir and renamed atomically, then every engine is told
POST /update_weights_from_disk {model_path, weight_version} (stock SGLang). It moves the whole model
every time; disk-delta, broadcast and P2P exist to avoid that at scale.

The engines are reached through `reload(model_path, version)` callbacks so this module stays
synchronous and independent of the caller's event loop; only the newest `keep` versions stay on disk.

Who calls it: lockstep.weights.factory builds it for `lockstep run` when spec.weightSync.transport
is auto (the one-machine default), and uses its `write` for the disk-delta baseline checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lockstep.weights.transport import TransferReport

if TYPE_CHECKING:
    import torch

MODEL_FILES = ("config.json", "tiny_tokenizer.json", "chat_template.jinja")
"""Non-weight files a version directory carries so an engine can load it alone."""

Reload = Callable[[str, int], None]
"""(model_path, version) -> None; raises when the engine refused the update."""


def version_dir(root: Path, version: int) -> Path:
    """ROOT/weight_vNNNNNN for `version`."""
    return Path(root) / f"weight_v{version:06d}"


class FromDiskTransport:
    """WeightTransport writing full checkpoints to `root` and reloading every engine from them."""

    name = "from-disk"

    def __init__(
        self,
        root: Path,
        reloads: Sequence[Reload],
        *,
        config_dir: Path | None = None,
        extra_files: Sequence[str] = ("config.json",),
        keep: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the engines read the newest version), got {keep}")
        self.root = Path(root)
        """Directory holding the versions."""
        self.reloads = list(reloads)
        """One reload callback per engine."""
        self.config_dir = config_dir
        """Checkpoint dir whose `extra_files` (config, tokenizer) are copied into every version."""
        self.extra_files = tuple(extra_files)
        """File names copied from config_dir (missing ones are skipped)."""
        self.keep = keep
        """How many newest versions stay on disk."""
        self.clock = clock
        self.root.mkdir(parents=True, exist_ok=True)

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> tuple[Path, int, int]:
        """Write version `version` atomically; returns (dir, tensor count, payload bytes)."""
        from safetensors.torch import save_file

        target = version_dir(self.root, version)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
        if not tensors:
            raise ValueError(f"version {version}: no tensors to write; the trainer exported nothing")
        save_file(
            tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "weight_version": str(version)}
        )
        if self.config_dir is not None:
            for name in self.extra_files:
                src = Path(self.config_dir) / name
                if src.is_file():
                    shutil.copy2(src, tmp / name)
        (tmp / "lockstep_version.json").write_text(json.dumps({"version": version}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
        payload = sum(t.numel() * t.element_size() for t in tensors.values())
        return target, len(tensors), payload

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> TransferReport:
        t0 = self.clock()
        path, count, payload = self.write(named_tensors, version)
        for reload in self.reloads:
            reload(str(path), version)
        self._prune(version)
        return TransferReport(
            version=version,
            transport=self.name,
            tensors=count,
            payload_bytes=payload,
            wire_bytes=payload * max(len(self.reloads), 1),
            seconds=self.clock() - t0,
        )

    def _prune(self, newest: int) -> None:
        for old in sorted(self.root.glob("weight_v*")):
            if (
                old.name.startswith("weight_v")
                and old.name[8:].isdigit()
                and int(old.name[8:]) <= newest - self.keep
            ):
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        return None
