"""The weight transport of a run, chosen by spec.weightSync.transport (seed §7.2).

Why it exists: the driver pushes every new version through one `WeightTransport`; which one depends
on the manifest and on what the engines of this process can do. This module is the one place that
maps the manifest onto the weights package's transports, for engines reachable from this process:

- `auto` (one machine) -> from-disk: each version is written as a full HF checkpoint under
  run_dir/weights/ and the engines reload it (POST /update_weights_from_disk). Chosen because it works
  with every engine (stock SGLang included), needs no process group or RDMA library, and a single
  machine always shares a disk; the faster transports are opt-in by name.
- `broadcast` -> BroadcastTransport over a weight-update group (gloo on CPU, NCCL on CUDA).
- `disk-delta` -> DiskDeltaTransport: the trainer publishes byte deltas under run_dir/delta/, each
  engine gets its own copy of the checkpoint (run_dir/engine-copies/<i>/) that is patched and reloaded.
  The first update publishes nothing and verifies trainer export and every copy against the baseline.
  spec.weightSync.diskDelta.path names the shared volume in a cluster; a local run keeps its deltas in
  the run dir.
- `p2p` -> P2PTransport: Mooncake TransferEngine over loopback TCP into each engine's receive buffer.
- `cuda-ipc` -> CudaIpcTransport to the single colocated engine, which must accept tensor updates.
  With trainer.device cpu the same code shares host memory (the documented CPU path of
  lockstep.weights.ipc, used to run it without a GPU); with trainer.device cuda the engine must be
  another process (a CUDA IPC handle cannot be opened by its creator), so it is refused for in-process
  engines and on a machine without CUDA.

Who calls it: lockstep.driver.components (`check_transport` before engines start, `build_transport`
once they are ready).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lockstep.api import RLJob
    from lockstep.driver.aio import AsyncRunner
    from lockstep.serving.client import EngineClient
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
        return  # host shared memory: the CPU path of lockstep.weights.ipc
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
    runner: AsyncRunner,
    clients: Sequence[EngineClient],
    device: str,
) -> WeightTransport:
    """The transport named by spec.weightSync.transport for `clients` (see the module docstring)."""
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
    run_dir: Path, model_dir: Path, runner: AsyncRunner, clients: Sequence[EngineClient]
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
    """Publisher over run_dir/delta, one fresh checkpoint copy per engine (patched, then reloaded)."""
    from lockstep.weights.disk_delta import DeltaPublisher, DiskDeltaTransport, http_reload

    spec = job.spec.weight_sync.disk_delta
    if str(spec.checksum) != "xxh3-128":
        raise ValueError(
            f"spec.weightSync.diskDelta.checksum: only xxh3-128 is implemented, got {spec.checksum}; remove it"
        )
    # Deltas and copies are caches of this process: a (resumed) run starts them again from the
    # checkpoint, since the publisher's byte baseline is the checkpoint on disk.
    root, copies = run_dir / "delta", run_dir / "engine-copies"
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(copies, ignore_errors=True)
    subscribers = []
    for i, url in enumerate(urls):
        local = copies / str(i)
        shutil.copytree(model_dir, local)
        subscribers.append((local, http_reload(url, pause_mode=str(job.spec.weight_sync.pause_mode))))
    publisher = DeltaPublisher(root, model_dir, encoding=str(spec.encoding), level=spec.zstd_level)  # type: ignore[arg-type]
    return FirstUpdateThenDeltas(DiskDeltaTransport(publisher, subscribers))


class FirstUpdateThenDeltas:
    """WeightTransport over DiskDeltaTransport whose first push is the transport's first update.

    The driver's first push (version 0, or the resumed version) runs `first_update` (nothing published;
    trainer export and every engine copy verified against the baseline) and reloads every engine from
    its verified copy, so engines hold exactly the baseline bytes even after the pre-flight filled them
    with noise. A resumed run then publishes its version as the first delta against the baseline.
    """

    name = "disk-delta"

    def __init__(self, inner: DiskDeltaTransport) -> None:
        self.inner = inner
        """The disk-delta transport (publisher and per-engine subscribers)."""
        self.started = False
        """Whether first_update ran."""

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> TransferReport:
        if self.started:
            return self.inner.push(named_tensors, version)
        tensors = list(named_tensors)  # read twice: layout check, then (resume) the first delta
        report = self.inner.first_update(tensors)
        self.started = True
        for local, reload in self.inner.subscribers:
            reload(local, report.version)
        if version == report.version:
            return report
        log.info("disk-delta: resumed at version %d, publishing it as the first delta", version)
        return self.inner.push(tensors, version)

    def close(self) -> None:
        self.inner.close()
