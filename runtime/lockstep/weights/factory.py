"""The weight transport of a run, chosen by spec.weightSync.transport (seed §7.2).

Why it exists: the driver pushes every new version through one `WeightTransport`; which one depends
on the manifest and on what the engines of this process can do. This module is the one place that
maps the manifest onto the weights package's transports, for engines reachable from this process:

- `auto` (one machine) -> from-disk: each version is written as a full HF checkpoint under
  run_dir/weights/ and the engines reload it (POST /update_weights_from_disk). Chosen because it works
  with every engine (stock SGLang included), needs no process group or RDMA library, and a single
  machine always shares a disk; the faster transports are opt-in by name.
- `broadcast` -> BroadcastTransport over a weight-update group (gloo on CPU, NCCL on CUDA).
- `disk-delta` -> DiskDeltaTransport (in lockstep.weights.disk_delta_local.LocalDiskDelta): byte deltas under run_dir/delta/, one
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

Every transport built here is wrapped in lockstep.weights.members.MemberTransport: before each push it
asks the engine membership (lockstep.serving.membership: a fixed list, or every address of the pool's
headless Service in a cluster) and the transport follows it, so an engine that joined gets the pushed
version too (from-disk: a full reload; disk-delta: a caught-up copy; broadcast: a new weight-update
group), p2p and cuda-ipc refuse a changed set with an error naming the fix, and each push reports
`weights_engines`.

In a cluster `auto` is not decided here: the operator's WeightChannel picks the transport from the
nodes the pods landed on and writes it into the job's config ConfigMap (lockstep.api.transport_choice,
/etc/lockstep/transport.json in a rank pod). `resolve_transport` (pure) and `wait_for_transport`
(waits for that file with an injected clock) turn `auto` into the channel's choice on rank 0 of
`lockstep trainer --serve`; an explicit transport in the spec always wins, and outside a pod a missing
file means the one-machine rule above.

Who calls it: lockstep.driver.components (`check_transport` before engines start),
lockstep.trainer.local.build_trainer_parts (`build_transport` once engines are ready) and
lockstep.trainer.server (`wait_for_transport`, `with_transport` on rank 0).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from lockstep.api import RLJob
from lockstep.api.transport_choice import TransportChoice, load_transport_choice
from lockstep.serving.membership import EngineMembers, StaticMembers
from lockstep.weights.broadcast import BroadcastTransport, EngineTarget
from lockstep.weights.disk_delta_local import LocalDiskDelta
from lockstep.weights.from_disk import MODEL_FILES, FromDiskTransport
from lockstep.weights.ipc import CudaIpcTransport
from lockstep.weights.members import (
    BroadcastFollower,
    DiskDeltaFollower,
    FixedFollower,
    Follower,
    FromDiskFollower,
    MemberTransport,
)
from lockstep.weights.p2p import P2PTransport, http_target
from lockstep.weights.pipeline import PipelineConfig

if TYPE_CHECKING:
    from lockstep.serving.client import EngineClient
    from lockstep.serving.loop import LoopThread
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
    requested = str(job.spec.weight_sync.transport)
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
    if str(job.spec.weight_sync.transport) == transport:
        return job
    wire = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    wire["spec"]["weightSync"]["transport"] = transport
    return RLJob.model_validate(wire)


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
    members: EngineMembers | None = None,
) -> MemberTransport:
    """The transport named by spec.weightSync.transport for `clients` (see the module docstring).

    `clients` are the engines known (and ready) now; `members` (default: exactly those) is asked again
    before every push, and the transport follows it (lockstep.weights.members).
    `master_address`: where the engines reach this process for the broadcast weight-update group
    (loopback on one machine; rank 0's MASTER_ADDR on a trainer pod).
    """
    ws = job.spec.weight_sync
    name = str(ws.transport)
    urls = sorted(c.base_url for c in clients)
    members = members or StaticMembers(tuple(urls))
    pause_mode = str(ws.pause_mode)
    follower: Follower
    if name == "broadcast":

        def make(engines: list[str], group_name: str) -> BroadcastTransport:
            return BroadcastTransport(
                [EngineTarget(u) for u in engines],
                backend="nccl" if device == "cuda" else "gloo",
                device=device,
                config=_pipeline(job),
                pause_mode=pause_mode,
                master_address=master_address,
                group_name=group_name,
            )

        follower = BroadcastFollower(make, urls)
    elif name == "disk-delta":
        follower = DiskDeltaFollower(_disk_delta(job, run_dir, model_dir, urls))
    elif name == "p2p":
        fix = "restart the trainer group (it binds the engines' receive buffers at start) or use broadcast"
        follower = FixedFollower(
            P2PTransport([http_target(u) for u in urls], config=_pipeline(job)), urls, fix
        )
    elif name == "cuda-ipc":
        (url,) = urls  # check_transport allowed one engine only
        fix = "cuda-ipc serves the one colocated engine of this trainer; restart the trainer with that engine"
        inner = CudaIpcTransport(url, device=device, config=_pipeline(job), pause_mode=pause_mode)
        follower = FixedFollower(inner, urls, fix)
    elif name == "auto":
        follower = FromDiskFollower(_from_disk(run_dir, model_dir), runner, clients)
    else:
        raise ValueError(
            f"{FIELD}: unknown transport {name!r}; use auto, broadcast, disk-delta, p2p or cuda-ipc"
        )
    return MemberTransport(members, follower, urls)


def _pipeline(job: RLJob) -> PipelineConfig:
    return PipelineConfig(bucket_bytes=job.spec.weight_sync.bucket_mib << 20)


def _from_disk(run_dir: Path, model_dir: Path) -> FromDiskTransport:
    """Full checkpoints under run_dir/weights/; the engines' reloads are set before each push."""
    return FromDiskTransport(run_dir / "weights", [], config_dir=model_dir, extra_files=MODEL_FILES)


def _disk_delta(job: RLJob, run_dir: Path, model_dir: Path, urls: list[str]) -> LocalDiskDelta:
    spec = job.spec.weight_sync.disk_delta
    return LocalDiskDelta(
        run_dir,
        model_dir,
        urls,
        encoding=str(spec.encoding),
        level=spec.zstd_level,
        pause_mode=str(job.spec.weight_sync.pause_mode),
        checksum=cast("ChecksumAlgorithm", str(spec.checksum)),  # the API enum has the same values
    )
