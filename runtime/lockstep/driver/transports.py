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

Every transport built here is wrapped in lockstep.driver.pushes.MemberTransport: before each push it
asks the engine membership (lockstep.driver.membership: a fixed list, or every address of the pool's
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
lockstep.driver.trainer.build_trainer_parts (`build_transport` once engines are ready) and
lockstep.driver.trainer_server (`wait_for_transport`, `with_transport` on rank 0).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from lockstep.api.transport_choice import TransportChoice, load_transport_choice

if TYPE_CHECKING:
    import torch

    from lockstep.api import RLJob
    from lockstep.driver.membership import EngineMembers
    from lockstep.driver.pushes import MemberTransport
    from lockstep.serving.client import EngineClient
    from lockstep.serving.loop import LoopThread
    from lockstep.weights.disk_delta import DiskDeltaTransport
    from lockstep.weights.from_disk import FromDiskTransport
    from lockstep.weights.pipeline import PipelineConfig
    from lockstep.weights.st_bytes import ChecksumAlgorithm
    from lockstep.weights.transport import TransferReport

log = logging.getLogger(__name__)

FIELD = "spec.weightSync.transport"
"""The manifest field every refusal names."""

MODEL_FILES = ("config.json", "tiny_tokenizer.json", "chat_template.jinja")
"""Non-weight files a from-disk version directory carries so an engine can load it alone."""


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
    from lockstep.api import RLJob as Job

    if str(job.spec.weight_sync.transport) == transport:
        return job
    wire = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    wire["spec"]["weightSync"]["transport"] = transport
    return Job.model_validate(wire)


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
    before every push, and the transport follows it (lockstep.driver.pushes).
    `master_address`: where the engines reach this process for the broadcast weight-update group
    (loopback on one machine; rank 0's MASTER_ADDR on a trainer pod).
    """
    from lockstep.driver.membership import StaticMembers
    from lockstep.driver.pushes import (
        BroadcastFollower,
        DiskDeltaFollower,
        FixedFollower,
        Follower,
        FromDiskFollower,
        MemberTransport,
    )

    ws = job.spec.weight_sync
    name = str(ws.transport)
    urls = sorted(c.base_url for c in clients)
    members = members or StaticMembers(tuple(urls))
    pause_mode = str(ws.pause_mode)
    follower: Follower
    if name == "broadcast":
        from lockstep.weights.broadcast import BroadcastTransport, EngineTarget

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
        from lockstep.weights.p2p import P2PTransport, http_target

        fix = "restart the trainer group (it binds the engines' receive buffers at start) or use broadcast"
        follower = FixedFollower(
            P2PTransport([http_target(u) for u in urls], config=_pipeline(job)), urls, fix
        )
    elif name == "cuda-ipc":
        from lockstep.weights.ipc import CudaIpcTransport

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
    from lockstep.weights.pipeline import PipelineConfig

    return PipelineConfig(bucket_bytes=job.spec.weight_sync.bucket_mib << 20)


def _from_disk(run_dir: Path, model_dir: Path) -> FromDiskTransport:
    """Full checkpoints under run_dir/weights/; the engines' reloads are set before each push."""
    from lockstep.weights.from_disk import FromDiskTransport

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


class LocalDiskDelta:
    """WeightTransport: disk-delta with one checkpoint copy per engine, patched here and reloaded there.

    The first push (version 0 after an SFT warm start, or the resumed version) is the transport's first
    update. Its byte baseline is the trainer's export at that moment, written once as an HF checkpoint
    (run_dir/delta-base/): after a warm start or a resume the trainer no longer holds the bytes of
    spec.model.checkpoint, and deltas must start from what the engines hold. Every engine gets a copy
    (run_dir/engine-copies/<engine address>/); `first_update` publishes nothing and verifies the
    trainer's layout and every copy against the baseline; each engine then reloads its verified copy
    (so engines hold exactly the baseline even after the pre-flight filled them with noise). Later
    pushes publish deltas under run_dir/delta/, patch every copy, then reload. The three directories
    are caches of this process: each start of the run builds them again from the trainer's export.

    Membership (`follow`): an engine that joins after the first update gets a copy of the baseline,
    verified against it (init_local) and caught up through every published delta (apply_delta walks
    the chain: deltas are never pruned), before the next push patches and reloads it like the others;
    an engine that left loses its copy. In a cluster run_dir must be on the shared volume, mounted at
    the same path in the engine pods (the operator mounts it at /shared in both): the engines read
    their copies from there (the operator sets LOCKSTEP_RUN_DIR on it for the trainer ranks).
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
        """The engines the next push reaches (`follow` sets them)."""
        self.pause_mode = pause_mode
        """How generation pauses around each engine's reload."""
        self.encoding = encoding
        """spec.weightSync.diskDelta.encoding."""
        self.level = level
        """spec.weightSync.diskDelta.zstdLevel."""
        self.checksum = checksum
        """spec.weightSync.diskDelta.checksum: xxh3-128, blake3 or adler32 (the index records it)."""
        self.inner: DiskDeltaTransport | None = None
        """The disk-delta transport, built at the first push."""
        self.base_version = 0
        """The first update's version (the baseline's)."""
        self.baseline: Path | None = None
        """The baseline checkpoint (under run_dir/delta-base/), written by the first update."""

    def copy_of(self, url: str) -> Path:
        """run_dir/engine-copies/<host_port>: the engine's own checkpoint copy."""
        key = "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in url.split("://", 1)[-1])
        return self.run_dir / "engine-copies" / key

    def follow(self, urls: Sequence[str]) -> None:
        """Make the next push reach exactly `urls` (see the class docstring)."""
        from lockstep.weights.disk_delta import apply_delta, http_reload, init_local

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

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> TransferReport:
        if self.inner is not None:
            return self.inner.push(named_tensors, version)
        return self._first_update(list(named_tensors), version)

    def _first_update(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> TransferReport:
        from lockstep.weights.disk_delta import DeltaPublisher, DiskDeltaTransport, http_reload
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
        for url in self.urls:
            local = self.copy_of(url)
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
