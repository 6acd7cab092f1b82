"""disk-delta for engines whose checkpoints live on this host's (or a shared) disk: one copy per engine.

Why it exists: DiskDeltaTransport (disk_delta.py) publishes deltas and patches the copies it is given;
a run needs the copies themselves. LocalDiskDelta keeps one checkpoint copy per engine under the run
dir, makes the baseline at the first update, and follows the engine set: an engine that joins gets a
verified copy caught up through the delta chain, one that leaves loses its copy. docs/weights.md has
the directory layout.

Who calls it: lockstep.weights.factory (spec.weightSync.transport disk-delta).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.weights import phases
from lockstep.weights.disk_delta import (
    DeltaPublisher,
    DiskDeltaTransport,
    apply_delta,
    http_reload,
    init_local,
)
from lockstep.weights.from_disk import MODEL_FILES, FromDiskTransport

if TYPE_CHECKING:
    import torch

    from lockstep.models.st_bytes import ChecksumAlgorithm
    from lockstep.weights.transport import TransferReport

log = logging.getLogger(__name__)


class LocalDiskDelta:
    """WeightTransport: disk-delta with one checkpoint copy per engine, patched here and reloaded there.

    The baseline is the trainer's export at the first update (after a warm start or a resume the
    trainer no longer holds spec.model.checkpoint's bytes), written once under run_dir/delta-base/ and
    copied to run_dir/engine-copies/<engine>/; later updates publish under run_dir/delta/, patch every
    copy, then reload. `follow` gives a joining engine a verified copy caught up through every delta.
    docs/weights.md ("Disk-delta in a run") has the layout and why.
    """

    name = "disk-delta"

    def __init__(
        self,
        run_dir: Path,
        model_dir: Path,
        urls: Sequence[str],
        *,
        encoding: str = "xor",
        level: int = 1,
        pause_mode: str = "retract",
        checksum: ChecksumAlgorithm = "xxh3-128",
    ) -> None:
        self.run_dir = Path(run_dir)
        """Where delta/, delta-base/ and engine-copies/ live."""
        self.model_dir = Path(model_dir)
        """The initial checkpoint (its config and tokenizer files go into the baseline)."""
        self.urls = list(urls)
        """The engines the next update reaches (`follow` sets them)."""
        self.pause_mode = pause_mode
        """How generation pauses around each engine's reload."""
        self.encoding = encoding
        """spec.weightSync.diskDelta.encoding."""
        self.level = level
        """spec.weightSync.diskDelta.zstdLevel."""
        self.checksum = checksum
        """spec.weightSync.diskDelta.checksum: xxh3-128, blake3 or adler32 (the index records it)."""
        self.inner: DiskDeltaTransport | None = None
        """The disk-delta transport, built at the first update."""
        self.base_version = 0
        """The first update's version (the baseline's)."""
        self.baseline: Path | None = None
        """The baseline checkpoint (under run_dir/delta-base/), written by the first update."""

    def copy_of(self, url: str) -> Path:
        """run_dir/engine-copies/<host_port>: the engine's own checkpoint copy."""
        key = "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in url.split("://", 1)[-1])
        return self.run_dir / "engine-copies" / key

    def follow(self, urls: Sequence[str]) -> None:
        """Make the next update reach exactly `urls` (see the class docstring)."""
        self.urls = list(urls)
        if self.inner is None or self.baseline is None:
            return  # the first update copies the baseline for every engine of the moment
        base, root = self.baseline, self.run_dir / "delta"
        subscribers = []
        for url in self.urls:
            local = self.copy_of(url)
            if not local.is_dir():
                shutil.copytree(base, local)
                init_local(local, root, self.base_version)
                caught = apply_delta(root, local, self.inner.publisher.version)
                log.info("disk-delta: new engine %s: copy at version %d (%d deltas)", url, caught.to_version,
                         len(caught.versions))  # fmt: skip
            subscribers.append((local, http_reload(url, pause_mode=self.pause_mode)))
        kept = {p.name for p, _ in subscribers}
        for old in (self.run_dir / "engine-copies").glob("*"):
            if old.name not in kept:
                shutil.rmtree(old, ignore_errors=True)  # that engine left
        self.inner.subscribers = subscribers

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> TransferReport:
        if self.inner is not None:
            return self.inner.update_weights(named_tensors, version)
        with phases.measure() as timer:
            report = self._first_update(list(phases.timed(named_tensors, "gather")), version)
        return timer.stamp(report)

    def _first_update(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> TransferReport:
        root, base, copies = (
            self.run_dir / "delta",
            self.run_dir / "delta-base",
            self.run_dir / "engine-copies",
        )
        for stale in (root, base, copies):
            shutil.rmtree(stale, ignore_errors=True)
        writer = FromDiskTransport(base, [], config_dir=self.model_dir, extra_files=MODEL_FILES)
        baseline, _, _ = writer.write(tensors, version)
        subscribers = []
        for url in self.urls:
            local = self.copy_of(url)
            with phases.phase("patch"):
                shutil.copytree(baseline, local)
            subscribers.append((local, http_reload(url, pause_mode=self.pause_mode)))
        encoding: Any = self.encoding  # one of the codec's encodings (the API enum)
        publisher = DeltaPublisher(
            root, baseline, encoding=encoding, level=self.level, base_version=version, checksum=self.checksum
        )
        self.inner = DiskDeltaTransport(publisher, subscribers)
        self.base_version, self.baseline = version, baseline
        report = self.inner.first_update(tensors)
        for local, reload in subscribers:
            reload(local, version)
        return report

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
