"""The weight transport of a run, chosen by spec.weightSync.transport (seed §7.2).

Why it exists: the driver pushes every new version through one `WeightTransport`; which one depends
on the manifest and on what the engines of this process can do. This module is the one place that
maps the manifest onto the weights package's transports, for engines reachable from this process:

- `auto` (one machine) -> from-disk: each version is written as a full HF checkpoint under
  run_dir/weights/ and the engines reload it (POST /update_weights_from_disk). Chosen because it works
  with every engine (stock SGLang included), needs no process group or RDMA library, and a single
  machine always shares a disk; the faster transports are opt-in by name.
- `broadcast` -> BroadcastTransport over a weight-update group (gloo on CPU, NCCL on CUDA).
- `disk-delta` -> DiskDeltaTransport (in LocalDiskDelta): byte deltas under run_dir/delta/, one
  checkpoint copy per engine, patched and reloaded. The first update publishes nothing: its baseline is
  the trainer's export at the first push, verified byte-identical on both sides.
  spec.weightSync.diskDelta.path names the shared volume in a cluster; a local run keeps its deltas in
  the run dir.
- `p2p` -> P2PTransport: Mooncake TransferEngine over loopback TCP into each engine's receive buffer.
- `cuda-ipc` -> CudaIpcTransport to the single colocated engine, which must accept tensor updates.
  With trainer.device cpu the same code shares host memory (the documented CPU path of
  lockstep.weights.ipc, used to run it without a GPU; in-process engines only); with trainer.device
  cuda the engine must be another process (a CUDA IPC handle cannot be opened by its creator), so it
  is refused for in-process engines and on a machine without CUDA.

Who calls it: lockstep.driver.components (`check_transport` before engines start, `build_transport`
once they are ready).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from lockstep.api import RLJob
    from lockstep.serving.client import EngineClient
    from lockstep.serving.loop import LoopThread
    from lockstep.weights.disk_delta import DiskDeltaTransport
    from lockstep.weights.pipeline import PipelineConfig
    from lockstep.weights.transport import TransferReport, WeightTransport

log = logging.getLogger(__name__)

FIELD = "spec.weightSync.transport"
"""The manifest field every refusal names."""

MODEL_FILES = ("config.json", "tiny_tokenizer.json", "chat_template.jinja")
"""Non-weight files a from-disk version directory carries so an engine can load it alone."""


def needs_tensor_updates(job: RLJob) -> bool:
    """Whether in-process engines must accept /update_weights_from_tensor (only cuda-ipc sends it)."""
    return str(job.spec.weight_sync.transport) == "cuda-ipc"


def check_transport(job: RLJob, *, external_engines: bool, cuda_available: bool) -> None:
    """Refuse, before anything starts, a transport this process cannot run; the error names the field."""
    name = str(job.spec.weight_sync.transport)
    if name != "cuda-ipc":
        return
    if max(job.spec.rollout.replicas, 1) != 1:
        raise ValueError(
            f"{FIELD}: cuda-ipc hands weights to the one colocated engine; set spec.rollout.replicas to 1 "
            "or choose broadcast"
        )
    if str(job.spec.trainer.device) != "cuda":
        if external_engines:
            raise ValueError(
                f"{FIELD}: cuda-ipc with spec.trainer.device cpu shares host memory with an engine of this "
                "process only; drop --engine-url, or use broadcast for an engine in another process"
            )
        return  # host shared memory with the in-process engine: the CPU path of lockstep.weights.ipc
    if not cuda_available:
        raise ValueError(
            f"{FIELD}: cuda-ipc with spec.trainer.device cuda needs a CUDA device, and this machine has none; "
            "use auto or broadcast (or trainer.device cpu)"
        )
    if not external_engines:
        raise ValueError(
            f"{FIELD}: cuda-ipc needs the engine in another process (a CUDA IPC handle cannot be opened by "
            "its creator): start `lockstep engine --allow-tensor-updates` and pass --engine-url"
        )


def build_transport(
    job: RLJob,
    run_dir: Path,
    model_dir: Path,
    runner: LoopThread,
    clients: Sequence[EngineClient],
    device: str,
    master_address: str = "127.0.0.1",
) -> WeightTransport:
    """The transport named by spec.weightSync.transport for `clients` (see the module docstring).

    `master_address`: where the engines reach this process for the broadcast weight-update group
    (loopback on one machine; rank 0's MASTER_ADDR on a trainer pod).
    """
    ws = job.spec.weight_sync
    name = str(ws.transport)
    urls = [c.base_url for c in clients]
    pause_mode = str(ws.pause_mode)
    if name == "broadcast":
        from lockstep.weights.broadcast import BroadcastTransport, EngineTarget

        return BroadcastTransport(
            [EngineTarget(u) for u in urls],
            backend="nccl" if device == "cuda" else "gloo",
            device=device,
            config=_pipeline(job),
            pause_mode=pause_mode,
            master_address=master_address,
        )
    if name == "disk-delta":
        return _disk_delta(job, run_dir, model_dir, urls)
    if name == "p2p":
        from lockstep.weights.p2p import P2PTransport, http_target

        return P2PTransport([http_target(u) for u in urls], config=_pipeline(job))
    if name == "cuda-ipc":
        from lockstep.weights.ipc import CudaIpcTransport

        (url,) = urls  # check_transport allowed one engine only
        return CudaIpcTransport(url, device=device, config=_pipeline(job), pause_mode=pause_mode)
    if name != "auto":
        raise ValueError(
            f"{FIELD}: unknown transport {name!r}; use auto, broadcast, disk-delta, p2p or cuda-ipc"
        )
    return _from_disk(run_dir, model_dir, runner, clients)


def _pipeline(job: RLJob) -> PipelineConfig:
    from lockstep.weights.pipeline import PipelineConfig

    return PipelineConfig(bucket_bytes=job.spec.weight_sync.bucket_mib << 20)


def _from_disk(
    run_dir: Path, model_dir: Path, runner: LoopThread, clients: Sequence[EngineClient]
) -> WeightTransport:
    from lockstep.weights.from_disk import FromDiskTransport

    def make_reload(client: EngineClient) -> Callable[[str, int], None]:
        def reload(path: str, version: int) -> None:
            runner.run(client.update_weights_from_disk(path, weight_version=version))

        return reload

    return FromDiskTransport(
        run_dir / "weights", [make_reload(c) for c in clients], config_dir=model_dir, extra_files=MODEL_FILES
    )


def _disk_delta(job: RLJob, run_dir: Path, model_dir: Path, urls: list[str]) -> WeightTransport:
    spec = job.spec.weight_sync.disk_delta
    if str(spec.checksum) != "xxh3-128":
        raise ValueError(
            f"spec.weightSync.diskDelta.checksum: only xxh3-128 is implemented, got {spec.checksum}; remove it"
        )
    return LocalDiskDelta(
        run_dir,
        model_dir,
        urls,
        encoding=str(spec.encoding),
        level=spec.zstd_level,
        pause_mode=str(job.spec.weight_sync.pause_mode),
    )


class LocalDiskDelta:
    """WeightTransport: disk-delta for the engines of one machine, one checkpoint copy per engine.

    The first push (version 0 after an SFT warm start, or the resumed version) is the transport's first
    update. Its byte baseline is the trainer's export at that moment, written once as an HF checkpoint
    (run_dir/delta-base/): after a warm start or a resume the trainer no longer holds the bytes of
    spec.model.checkpoint, and deltas must start from what the engines hold. Every engine gets a copy
    (run_dir/engine-copies/<i>/); `first_update` publishes nothing and verifies the trainer's layout and
    every copy against the baseline; each engine then reloads its verified copy (so engines hold exactly
    the baseline even after the pre-flight filled them with noise). Later pushes publish deltas under
    run_dir/delta/, patch every copy, then reload. The three directories are caches of this process:
    each start of the run builds them again from the trainer's export.
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
    ) -> None:
        from lockstep.weights.disk_delta import http_reload

        self.run_dir = Path(run_dir)
        """Where delta/, delta-base/ and engine-copies/ live."""
        self.model_dir = Path(model_dir)
        """The initial checkpoint (its config and tokenizer files go into the baseline)."""
        self.reloads = [http_reload(u, pause_mode=pause_mode) for u in urls]
        """One reload (pause, /update_weights_from_disk, continue) per engine."""
        self.encoding = encoding
        """spec.weightSync.diskDelta.encoding."""
        self.level = level
        """spec.weightSync.diskDelta.zstdLevel."""
        self.inner: DiskDeltaTransport | None = None
        """The disk-delta transport, built at the first push."""

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> TransferReport:
        if self.inner is not None:
            return self.inner.push(named_tensors, version)
        return self._first_update(list(named_tensors), version)

    def _first_update(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> TransferReport:
        from lockstep.weights.disk_delta import DeltaPublisher, DiskDeltaTransport
        from lockstep.weights.from_disk import FromDiskTransport

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
        for i, reload in enumerate(self.reloads):
            local = copies / str(i)
            shutil.copytree(baseline, local)
            subscribers.append((local, reload))
        encoding: Any = self.encoding  # one of the codec's encodings (the API enum)
        publisher = DeltaPublisher(root, baseline, encoding=encoding, level=self.level, base_version=version)
        self.inner = DiskDeltaTransport(publisher, subscribers)
        report = self.inner.first_update(tensors)
        for local, reload in subscribers:
            reload(local, version)
        return report

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
