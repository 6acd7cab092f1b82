"""From-disk weight transport: write a full HF checkpoint per version, engines reload it.

Why it exists: the simplest transport that works everywhere the trainer and the engines share a
file system (one machine, a shared volume): each version is a complete HF-layout checkpoint directory
`ROOT/weight_vNNNNNN/` (model.safetensors + config.json + whatever `extra_files` names, e.g. the
tokenizer), written to a temp dir and renamed atomically, then every engine is told
POST /update_weights_from_disk {model_path, weight_version} (stock SGLang). It moves the whole model
every time; disk-delta, broadcast and P2P exist to avoid that at scale.

The engines are reached through `reload(model_path, version)` callbacks; `follow(urls)` sets one per
engine (an HTTP reload on this transport's private event loop), so an engine that joined simply loads
the next full version like every other. Only the newest `keep` versions stay on disk.

Who calls it: lockstep.weights.factory builds it when spec.weightSync.transport is auto (the
one-machine default); lockstep.weights.disk_delta_local uses its `write` for the baseline checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lockstep.models.tokenizer import TOKENIZER_FILES
from lockstep.serving.client import EngineClient
from lockstep.serving.loop import LoopThread
from lockstep.weights import phases
from lockstep.weights.transport import TransferReport

if TYPE_CHECKING:
    import torch

MODEL_FILES = ("config.json", *TOKENIZER_FILES)
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
        self._io: LoopThread | None = None
        self._clients: dict[str, EngineClient] = {}

    def follow(self, urls: list[str]) -> None:
        """Reload exactly these engines from the next version on (over HTTP, /update_weights_from_disk)."""
        if self._io is None:
            self._io = LoopThread("from-disk-io")  # an update is synchronous; the client is async
        for url in [u for u in self._clients if u not in urls]:
            self._io.run(self._clients.pop(url).aclose())  # that engine left
        self.reloads = [self._http_reload(url) for url in urls]

    def _http_reload(self, url: str) -> Reload:
        """POST /update_weights_from_disk to `url`; an error names the engine."""
        io = self._io
        assert io is not None
        if url not in self._clients:
            self._clients[url] = EngineClient(url, retries=3)
        client = self._clients[url]

        def reload(path: str, version: int) -> None:
            try:
                io.run(client.update_weights_from_disk(path, weight_version=version))
            except Exception as e:
                if url in str(e):
                    raise
                raise RuntimeError(f"engine {url}: {type(e).__name__}: {e}") from e

        return reload

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> tuple[Path, int, int]:
        """Write version `version` atomically; returns (dir, tensor count, payload bytes)."""
        from safetensors.torch import save_file

        target = version_dir(self.root, version)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with phases.phase("bucket"):
            tensors = {
                name: t.detach().to("cpu").contiguous() for name, t in phases.timed(named_tensors, "gather")
            }
        if not tensors:
            raise ValueError(f"version {version}: no tensors to write; the trainer exported nothing")
        with phases.phase("transfer"):
            save_file(
                tensors,
                str(tmp / "model.safetensors"),
                metadata={"format": "pt", "weight_version": str(version)},
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

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> TransferReport:
        with phases.measure(self.clock) as timer:
            path, count, payload = self.write(named_tensors, version)
            with phases.phase("engine_load"):  # each engine pauses, reads the files and swaps itself
                for reload in self.reloads:
                    reload(str(path), version)
            self._prune(version)
        report = TransferReport(
            version=version,
            transport=self.name,
            tensors=count,
            payload_bytes=payload,
            wire_bytes=payload * max(len(self.reloads), 1),
        )
        return timer.stamp(report)

    def _prune(self, newest: int) -> None:
        for old in sorted(self.root.glob("weight_v*")):
            if (
                old.name.startswith("weight_v")
                and old.name[8:].isdigit()
                and int(old.name[8:]) <= newest - self.keep
            ):
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        if self._io is None:
            return
        for client in self._clients.values():
            self._io.run(client.aclose())
        self._clients.clear()
        self._io.close()
        self._io = None
