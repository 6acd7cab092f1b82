"""The weight transport of a run, chosen by spec.weightSync.transport (§7.2).

Why it exists: this is the one place that builds the transports of this package, from a TransportConfig
(which lockstep.config.trainer makes from the manifest).
`auto` on one machine is in-process when every engine is embedded in this process (the trainer's
tensors are copied into them, no disk in the loop), else from-disk (full checkpoints reloaded by every
engine: works with stock SGLang, needs no process group or RDMA library, and one machine always shares
a disk); the faster transports are opt-in by name. In a cluster the operator's WeightChannel resolves `auto` from the nodes the pods
landed on and writes its choice into the job's ConfigMap; `resolve_transport` (pure) and
`wait_for_transport` read it on rank 0 of the trainer group. `check_transport` refuses, before
anything starts, a transport this process cannot run. docs/weights.md and docs/trainer.md explain
each transport and the `auto` rule.

Who calls it: lockstep.driver.components (`check_transport`), lockstep.trainer.parts
(`build_transport`), lockstep.trainer.server (`wait_for_transport`), lockstep.config.trainer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from lockstep.api import DeltaEncoding, Device, PauseMode, Transport
from lockstep.api.rljob import Checksum
from lockstep.api.transport_choice import TransportChoice, load_transport_choice
from lockstep.weights.adapter import AdapterSync, Mode
from lockstep.weights.broadcast import BroadcastTransport, EngineTarget
from lockstep.weights.disk_delta_local import LocalDiskDelta
from lockstep.weights.disk_delta_shared import SharedDiskDelta
from lockstep.weights.fallback import FallbackTransport
from lockstep.weights.from_disk import MODEL_FILES, FromDiskTransport
from lockstep.weights.inprocess import Handoff, InProcessTransport
from lockstep.weights.ipc import CudaIpcTransport
from lockstep.weights.p2p import P2PTransport, http_target
from lockstep.weights.pipeline import PipelineConfig
from lockstep.weights.quantizing import QuantizingTransport
from lockstep.weights.transport import WeightTransport

if TYPE_CHECKING:
    from lockstep.models.st_bytes import ChecksumAlgorithm
    from lockstep.numerics.recipe import Recipe

log = logging.getLogger(__name__)

FIELD = "spec.weightSync.transport"
"""The manifest field every refusal names."""

LOCAL_RULE = (
    "auto: in-process for engines embedded in this process, else from-disk (no transport file from "
    "the operator; one machine shares a disk)"
)
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


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterTransfer:
    """A LoRA job's adapter, the only weights its updates carry (spec.model.lora)."""

    name: str
    """The adapter's name on the engines (spec.model.lora.adapterName, else the job's name)."""
    alpha: int
    """LoRA alpha (the engines scale the adapter by alpha / rank)."""
    dropout: float
    """LoRA dropout, as the adapter's config records it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportConfig:
    """What the manifest says about moving weights (spec.weightSync, the serving recipe, the trainer's
    device, a LoRA adapter); lockstep.config.trainer builds it. `build_transport` adds where this
    process runs."""

    transport: Transport = Transport.AUTO
    """spec.weightSync.transport (`auto`: the operator's choice in a cluster, else the local rule)."""
    job_name: str = ""
    """metadata.name: names the WeightChannel `<job>-weights` in a missing-choice error."""
    bucket_bytes: int = 512 << 20
    """Bucket size of the weight pipeline (spec.weightSync.bucketMiB)."""
    pause_mode: PauseMode = PauseMode.RETRACT
    """How engines pause generation around an update (spec.weightSync.pauseMode)."""
    delta_encoding: DeltaEncoding = DeltaEncoding.XOR
    """Disk-delta: byte encoding (spec.weightSync.diskDelta.encoding)."""
    delta_zstd_level: int = 1
    """Disk-delta: Zstandard level."""
    delta_checksum: Checksum = Checksum.XXH3_128
    """Disk-delta: checksum of the patched tensors."""
    delta_volume_claim: str | None = None
    """Disk-delta: the shared ReadWriteMany claim (spec.weightSync.diskDelta.volumeClaim), if any."""
    delta_agent_port: int | None = None
    """Disk-delta per host: the port of the agent beside every engine (the operator renders the agents
    for `transport: disk-delta` with a shared volume; a trainer rank in a pod sets it); None: the
    trainer patches one copy per engine itself (lockstep.weights.disk_delta_local)."""
    serving: Recipe | None = None
    """Low-precision serving (spec.rollout.precision, bf16Modules): every update is quantized by the
    shared quantizer (QuantizingTransport); None serves the trainer's dtype."""
    trainer_device: Device = Device.CPU
    """spec.trainer.device: what `check_transport` can run on this machine."""
    adapter: AdapterTransfer | None = None
    """A LoRA job's adapter: then only the adapter moves (lockstep.weights.adapter); None: full weights."""


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
    config: TransportConfig,
    path: Path,
    *,
    in_pod: bool,
    timeout_s: float,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> TransportResolution:
    """`resolve_transport` for `config`, reading `path` until it decides (in a pod: up to `timeout_s`).

    An explicit transport never reads the file. A file that does not validate raises
    lockstep.api.TransportFileError naming it; no file in a pod after `timeout_s` raises
    TransportNotChosen naming the file and the WeightChannel to look at.
    """
    requested = config.transport
    deadline = clock() + timeout_s
    while True:
        choice = None if requested != "auto" else load_transport_choice(path)
        found = resolve_transport(requested, choice, in_pod=in_pod)
        if found is not None:
            return found
        if clock() >= deadline:
            raise TransportNotChosen(
                f"{FIELD} is auto and {path} did not appear within {timeout_s:.0f} s: the operator writes it "
                f"once the WeightChannel {config.job_name}-weights has status.transport (kubectl get wch); "
                "check that channel's reason, or set the transport explicitly"
            )
        sleep(poll_s)


def needs_tensor_updates(config: TransportConfig) -> bool:
    """Whether in-process engines must accept /update_weights_from_tensor (only cuda-ipc sends it;
    a LoRA job sends adapters to the LoRA routes instead)."""
    return config.transport is Transport.CUDA_IPC and config.adapter is None


def check_transport(config: TransportConfig, *, external_engines: bool, cuda_available: bool) -> None:
    """Refuse, before anything starts, a transport this process cannot run; the error names the field.

    Only what depends on this machine and process (CUDA, where the engine runs) is checked here; what
    the manifest alone decides (one engine for cuda-ipc, p2p into stock SGLang) is refused at apply
    (lockstep.api.rules). Quantized serving (spec.rollout.precision) travels over every transport:
    the QuantizingTransport wraps whichever is built."""
    if config.transport is not Transport.CUDA_IPC:
        return
    if config.trainer_device is not Device.CUDA:
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


ADAPTER_MODES: dict[Transport, Mode] = {
    Transport.AUTO: "disk",
    Transport.BROADCAST: "tensors",
    Transport.CUDA_IPC: "ipc",
}
"""How a LoRA job's adapter travels for each transport (p2p and disk-delta are refused at apply)."""


def adapter_transport(config: TransportConfig, run_dir: Path, model_dir: Path) -> AdapterSync:
    """The AdapterSync of a LoRA job: its adapter and the mode the transport selects; raises naming the
    field for p2p/disk-delta."""
    lora = config.adapter
    assert lora is not None
    mode = ADAPTER_MODES.get(config.transport)
    if mode is None:
        raise ValueError(
            f"{FIELD} {config.transport}: cannot carry a LoRA adapter; use auto, broadcast or cuda-ipc"
        )
    return AdapterSync(
        lora.name,
        mode=mode,
        alpha=lora.alpha,
        dropout=lora.dropout,
        base=str(model_dir),
        root=Path(run_dir) / "adapters",
    )


def build_transport(
    config: TransportConfig,
    run_dir: Path,
    model_dir: Path,
    urls: Sequence[str],
    device: str,
    master_address: str = "127.0.0.1",
    *,
    handoffs: Sequence[Handoff] = (),
) -> WeightTransport:
    """The transport `config` names (spec.weightSync.transport), reaching the engines `urls` (ready now).

    Before every update the trainer asks the membership again and the transport follows it
    (lockstep.weights.transport.update_members). `master_address`: where the engines reach this process
    for the broadcast weight-update group (loopback on one machine; rank 0's MASTER_ADDR in a pod).
    `handoffs`: the engines embedded in this process (`lockstep run` without --engine-url); when they
    are all the engines, `auto` hands the tensors over in memory (in-process) instead of from-disk.
    """
    ws = config
    urls = sorted(urls)
    if config.adapter is not None:  # only the adapter moves (lockstep.weights.adapter)
        adapter: WeightTransport = adapter_transport(config, run_dir, model_dir)
        adapter.follow(urls)
        return adapter
    pipeline = PipelineConfig(bucket_bytes=ws.bucket_bytes)
    transport: WeightTransport
    match ws.transport:
        case Transport.AUTO if handoffs and {h.url for h in handoffs} == set(urls):
            # one process: the engines take the trainer's tensors in memory (docs/weights.md)
            transport = InProcessTransport(handoffs, pause_mode=ws.pause_mode)
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
        case Transport.DISK_DELTA if ws.delta_agent_port is not None:  # every engine patches its own copy
            transport = SharedDiskDelta(
                run_dir, model_dir, urls, agent_port=ws.delta_agent_port, encoding=ws.delta_encoding,
                level=ws.delta_zstd_level, checksum=cast("ChecksumAlgorithm", ws.delta_checksum),
            )  # fmt: skip
        case Transport.DISK_DELTA:
            transport = LocalDiskDelta(
                run_dir, model_dir, urls, encoding=ws.delta_encoding, level=ws.delta_zstd_level,
                pause_mode=ws.pause_mode, checksum=cast("ChecksumAlgorithm", ws.delta_checksum),
            )  # fmt: skip
        case Transport.P2P:
            backend = "nccl" if device == "cuda" else "gloo"

            def broadcast(engines: list[str]) -> WeightTransport:  # where p2p is feasible, so is broadcast
                return BroadcastTransport(
                    [EngineTarget(u) for u in engines], backend=backend, device=device, config=pipeline,
                    pause_mode=ws.pause_mode, master_address=master_address, group_name="lockstep-fallback",
                )  # fmt: skip

            p2p = P2PTransport([http_target(u) for u in urls], config=pipeline, target_factory=http_target)
            transport = FallbackTransport(p2p, broadcast)
        case Transport.CUDA_IPC:
            (url,) = urls  # check_transport allowed one engine only
            transport = CudaIpcTransport(url, device=device, config=pipeline, pause_mode=ws.pause_mode)
    if config.serving is not None:  # low-precision serving: every push is quantized by the shared quantizer
        transport = QuantizingTransport(transport, config.serving)
    transport.follow(urls)
    return transport
