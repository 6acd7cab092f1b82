"""The weight transport of a run, chosen by spec.weightSync.transport (seed §7.2).

Why it exists: this is the one place that maps the manifest onto the transports of this package.
`auto` on one machine is from-disk (full checkpoints reloaded by every engine: works with stock SGLang,
needs no process group or RDMA library, and one machine always shares a disk); the faster transports
are opt-in by name. In a cluster the operator's WeightChannel resolves `auto` from the nodes the pods
landed on and writes its choice into the job's ConfigMap; `resolve_transport` (pure) and
`wait_for_transport` read it on rank 0 of the trainer group. `check_transport` refuses, before
anything starts, a transport this process cannot run. docs/weights.md and docs/trainer.md explain
each transport and the `auto` rule.

Who calls it: lockstep.driver.components (`check_transport`), lockstep.trainer.local
(`build_transport`), lockstep.trainer.server (`wait_for_transport`, `with_transport`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from lockstep.api import Device, RLJob, Transport
from lockstep.api.transport_choice import TransportChoice, load_transport_choice
from lockstep.numerics.recipe import recipe_of
from lockstep.weights.broadcast import BroadcastTransport, EngineTarget
from lockstep.weights.disk_delta_local import LocalDiskDelta
from lockstep.weights.from_disk import MODEL_FILES, FromDiskTransport
from lockstep.weights.ipc import CudaIpcTransport
from lockstep.weights.p2p import P2PTransport, http_target
from lockstep.weights.pipeline import PipelineConfig
from lockstep.weights.quantizing import QuantizingTransport
from lockstep.weights.transport import WeightTransport

if TYPE_CHECKING:
    from lockstep.weights.st_bytes import ChecksumAlgorithm

log = logging.getLogger(__name__)

FIELD = "spec.weightSync.transport"
"""The manifest field every refusal names."""

LOCAL_RULE = "auto: from-disk (no transport file from the operator; one machine shares a disk)"
"""The reason logged when `auto` falls back to the one-machine rule."""


@dataclass(frozen=True, slots=True)
class TransportResolution:
    """What spec.weightSync.transport means for this process, and why."""

    transport: str
    """The transport to build: a named one, or `auto` for the one-machine rule (from-disk)."""
    source: Literal["spec", "operator", "local"]
    """Who decided: the spec (explicit), the operator (the transport file), the local rule."""
    reason: str
    """One line saying why (the operator's reason for `operator`)."""


class TransportNotChosen(TimeoutError):
    """In a trainer pod with `auto`, the operator's transport file did not appear in time."""


def resolve_transport(
    requested: str, choice: TransportChoice | None, *, in_pod: bool
) -> TransportResolution | None:
    """The resolution rule (pure): explicit wins; `auto` + a file -> the file's transport; `auto`
    without a file -> the local rule outside a pod, None (keep waiting) in a trainer pod."""
    if requested != "auto":
        return TransportResolution(requested, "spec", f"{FIELD} is {requested}")
    if choice is not None:
        return TransportResolution(choice.transport, "operator", choice.reason)
    if in_pod:
        return None
    return TransportResolution("auto", "local", LOCAL_RULE)


def wait_for_transport(
    job: RLJob,
    path: Path,
    *,
    in_pod: bool,
    timeout_s: float,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> TransportResolution:
    """`resolve_transport` for `job`, reading `path` until it decides (in a pod: up to `timeout_s`).

    An explicit transport never reads the file. A file that does not validate raises
    lockstep.api.TransportFileError naming it; no file in a pod after `timeout_s` raises
    TransportNotChosen naming the file and the WeightChannel to look at.
    """
    requested = job.spec.weight_sync.transport
    deadline = clock() + timeout_s
    while True:
        choice = None if requested != "auto" else load_transport_choice(path)
        found = resolve_transport(requested, choice, in_pod=in_pod)
        if found is not None:
            return found
        if clock() >= deadline:
            raise TransportNotChosen(
                f"{FIELD} is auto and {path} did not appear within {timeout_s:.0f} s: the operator writes it "
                f"once the WeightChannel {job.metadata.name}-weights has status.transport (kubectl get wch); "
                "check that channel's reason, or set the transport explicitly"
            )
        sleep(poll_s)


def with_transport(job: RLJob, transport: str) -> RLJob:
    """A copy of `job` whose spec.weightSync.transport is `transport` (validated like the manifest)."""
    if job.spec.weight_sync.transport == transport:
        return job
    wire = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    wire["spec"]["weightSync"]["transport"] = transport
    return RLJob.model_validate(wire)


def needs_tensor_updates(job: RLJob) -> bool:
    """Whether in-process engines must accept /update_weights_from_tensor (only cuda-ipc sends it)."""
    return job.spec.weight_sync.transport is Transport.CUDA_IPC


def check_transport(job: RLJob, *, external_engines: bool, cuda_available: bool) -> None:
    """Refuse, before anything starts, a transport this process cannot run; the error names the field.

    Only what depends on this machine and process (CUDA, where the engine runs) is checked here; what
    the manifest alone decides (one engine for cuda-ipc, p2p into stock SGLang) is refused at apply
    (lockstep.api.rules). Quantized serving (spec.rollout.precision) travels over every transport:
    the QuantizingTransport wraps whichever is built."""
    if job.spec.weight_sync.transport is not Transport.CUDA_IPC:
        return
    if job.spec.trainer.device is not Device.CUDA:
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
    urls: Sequence[str],
    device: str,
    master_address: str = "127.0.0.1",
) -> WeightTransport:
    """The transport named by spec.weightSync.transport, reaching the engines `urls` (ready now).

    Before every update the trainer asks the membership again and the transport follows it
    (lockstep.weights.transport.update_members). `master_address`: where the engines reach this process
    for the broadcast weight-update group (loopback on one machine; rank 0's MASTER_ADDR in a pod).
    """
    ws = job.spec.weight_sync
    urls = sorted(urls)
    pipeline = PipelineConfig(bucket_bytes=ws.bucket_mib << 20)
    transport: WeightTransport
    match ws.transport:
        case Transport.AUTO:  # one machine: full checkpoints under run_dir/weights/, engines reload them
            transport = FromDiskTransport(
                run_dir / "weights", [], config_dir=model_dir, extra_files=MODEL_FILES
            )
        case Transport.BROADCAST:
            backend = "nccl" if device == "cuda" else "gloo"
            engines = [EngineTarget(u) for u in urls]
            transport = BroadcastTransport(
                engines, backend=backend, device=device, config=pipeline, pause_mode=ws.pause_mode,
                master_address=master_address,
            )  # fmt: skip
        case Transport.DISK_DELTA:
            transport = LocalDiskDelta(
                run_dir, model_dir, urls, encoding=ws.disk_delta.encoding, level=ws.disk_delta.zstd_level,
                pause_mode=ws.pause_mode, checksum=cast("ChecksumAlgorithm", ws.disk_delta.checksum),
            )  # fmt: skip
        case Transport.P2P:
            transport = P2PTransport([http_target(u) for u in urls], config=pipeline)
        case Transport.CUDA_IPC:
            (url,) = urls  # check_transport allowed one engine only
            transport = CudaIpcTransport(url, device=device, config=pipeline, pause_mode=ws.pause_mode)
    serving = recipe_of(job)
    if serving is not None:  # low-precision serving: every push is quantized by the shared quantizer
        transport = QuantizingTransport(transport, serving)
    transport.follow(urls)
    return transport
