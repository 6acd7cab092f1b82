"""spec.weightSync: how a weight version travels from the trainer to the engines (§7.2).

Why it exists: the weight-sync section is shared by RLJob and WeightChannel; it is declared once here.

Who uses it: lockstep.api.rljob (RLJobSpec.weightSync), lockstep.api.weightchannel,
lockstep.config.trainer (TransportConfig), the weight transports, the operator (the transport choice).
"""

from __future__ import annotations

import enum

from pydantic import Field

from lockstep.api.common import EMPTY_DEFAULT, ApiModel


class Transport(enum.StrEnum):
    """How a weight version travels from the trainer to the engines."""

    AUTO = "auto"
    BROADCAST = "broadcast"
    P2P = "p2p"
    DISK_DELTA = "disk-delta"
    CUDA_IPC = "cuda-ipc"


class DeltaEncoding(enum.StrEnum):
    """Disk-delta encoding."""

    XOR = "xor"
    OVERWRITE = "overwrite"


class Checksum(enum.StrEnum):
    """Checksum of patched tensors."""

    XXH3_128 = "xxh3-128"
    BLAKE3 = "blake3"
    ADLER32 = "adler32"


class PauseMode(enum.StrEnum):
    """What happens to in-flight requests while weights are installed (SGLang pause_generation)."""

    RETRACT = "retract"
    ABORT = "abort"
    IN_PLACE = "in_place"


class DiskDeltaSpec(ApiModel):
    """Disk-delta transport: publish compressed byte deltas to shared storage (§7.2.4)."""

    encoding: DeltaEncoding = DeltaEncoding.XOR
    """`xor` (smaller; apply exactly once) or `overwrite` (positions and values; idempotent)."""
    zstd_level: int = Field(default=1, ge=1, le=22)
    """Zstandard compression level."""
    checksum: Checksum = Checksum.XXH3_128
    """Checksum of each patched tensor."""
    volume_claim: str | None = Field(default=None, max_length=253)
    """PersistentVolumeClaim (ReadWriteMany) that holds the published versions in the cluster."""
    path: str | None = Field(default=None, min_length=1, max_length=1024, pattern=r"^/")
    """With transport disk-delta and a volumeClaim, each engine pod keeps the full checkpoint copy its
    agent patches on the node: a hostPath directory at this path (e.g. local NVMe; a directory per pod
    under it, writable by uid 1000), or an emptyDir of the pod when unset. The trainer publishes the
    versions on the volumeClaim."""


class WeightSyncSpec(ApiModel):
    """How trainer weights reach the engines after each update."""

    transport: Transport = Transport.AUTO
    """`auto` lets the operator choose from the topology (the choice and why appear in
    status.transport and status.transportReason)."""
    bucket_mib: int = Field(default=512, ge=1, le=65536, alias="bucketMiB")
    """Bucket size in MiB of the gather-convert-send pipeline."""
    check_weight_update_equal: bool = False
    """Preflight: fill engine tensors with noise, sync, and compare every tensor with the trainer's
    copy before the first step (also probes logprobs)."""
    update_interval: int = Field(default=1, ge=1, le=1000000)
    """Publish a new version every this many steps (version == step only with 1)."""
    pause_mode: PauseMode = PauseMode.RETRACT
    """What in-flight requests do during an update: `retract` (resume on new weights), `abort`, or
    `in_place`."""
    disk_delta: DiskDeltaSpec = Field(default_factory=DiskDeltaSpec, json_schema_extra=EMPTY_DEFAULT)
    """Settings of the disk-delta transport (used when it is chosen)."""
