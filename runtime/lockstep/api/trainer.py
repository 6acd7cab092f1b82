"""spec.trainer: the trainer's backend, size, parallelism, precision and memory (offload, local disk).

Why it exists: the trainer section is shared by RLJob and TrainerGroup; it is declared once here.

Who uses it: lockstep.api.rljob (RLJobSpec.trainer), lockstep.api.trainergroup, lockstep.api.rules,
lockstep.config.trainer (the backend's config), the operator (trainer pods and their volumes).
"""

from __future__ import annotations

import enum

from pydantic import Field

from lockstep.api.common import EMPTY_DEFAULT, ApiModel
from lockstep.api.rollout import Precision


class TrainerBackend(enum.StrEnum):
    """The training backend. Immutable after creation."""

    MEGATRON = "megatron"
    FSDP = "fsdp"


class Device(enum.StrEnum):
    """Where trainer ranks run."""

    CUDA = "cuda"
    CPU = "cpu"


class Offload(enum.StrEnum):
    """Where the trainer's state goes between steps (§7.1)."""

    NONE = "none"
    CPU = "cpu"
    DISK = "disk"


class LocalDiskSource(enum.StrEnum):
    """Where a trainer rank's node-local directory comes from."""

    HOST_PATH = "hostPath"
    EPHEMERAL = "ephemeral"


class LocalDiskSpec(ApiModel):
    """A node-local directory (NVMe) for what the trainer keeps off the GPU on disk: offloaded state
    (`offload: disk`) and the streamed optimizer state (`streamOptimizerStateToDisk`). Each rank pod
    mounts it at `path`; one machine (`lockstep run`) uses `path` itself. Without it they go to a
    temporary directory inside the container."""

    path: str = Field(min_length=2, max_length=1024, pattern=r"^(/[A-Za-z0-9_-][A-Za-z0-9._-]*)+$")
    """Absolute path where the trainer sees the directory (segments of letters, digits, `._-`, none
    starting with a dot), e.g. /mnt/nvme/lockstep. Each rank writes under `rank<N>/` in it."""
    source: LocalDiskSource = LocalDiskSource.EPHEMERAL
    """`ephemeral`: a volume created with each rank pod and deleted with it (a generic ephemeral
    volume: a claim of `size` from `storageClassName`, e.g. a local-NVMe class); `hostPath`: the
    node's own directory at `path` (created if missing; kept across pods)."""
    size: str | None = Field(
        default=None, max_length=32, pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
    )
    """Size of the ephemeral volume, a Kubernetes quantity such as 500Gi (ephemeral only)."""
    storage_class_name: str | None = Field(default=None, max_length=253)
    """StorageClass of the ephemeral volume; unset: the cluster's default (ephemeral only)."""


class Parallelism(ApiModel):
    """Trainer parallelism. TP x PP x CP must divide the GPU count; the rest is data parallel.
    EP does not multiply the GPU count: experts are spread over the same ranks (EP x ETP must divide
    GPUs / PP)."""

    tensor: int = Field(default=1, ge=1, le=1024)
    """Tensor parallel size (TP)."""
    pipeline: int = Field(default=1, ge=1, le=1024)
    """Pipeline parallel size (PP)."""
    context: int = Field(default=1, ge=1, le=1024)
    """Context parallel size (CP). Not built yet: only 1 is accepted (rule context-parallel-not-built)."""
    expert: int = Field(default=1, ge=1, le=1024)
    """Expert parallel size (EP) of MoE layers."""
    expert_tensor: int = Field(default=1, ge=1, le=1024)
    """Expert tensor parallel size (ETP) of MoE layers."""


class TrainerSpec(ApiModel):
    """The trainer: backend, size, parallelism, precision and memory."""

    backend: TrainerBackend = TrainerBackend.MEGATRON
    """`megatron` or `fsdp` (FSDP2). Immutable after creation."""
    image: str | None = Field(default=None, max_length=512)
    """Container image of the trainer pods; unset uses the operator's default."""
    device: Device = Device.CUDA
    """`cuda`, or `cpu` for local runs and tests (gloo)."""
    nodes: int = Field(default=1, ge=1, le=4096)
    """Trainer nodes."""
    gpus_per_node: int = Field(default=8, ge=1, le=64)
    """GPUs per trainer node, one rank each (with device cpu: ranks per node)."""
    parallelism: Parallelism = Field(default_factory=Parallelism, json_schema_extra=EMPTY_DEFAULT)
    """TP, PP, CP, EP, ETP."""
    precision: Precision = Precision.BF16
    """Training weight precision."""
    offload: Offload = Offload.NONE
    """Move weights, gradients and optimizer state off the GPU between steps: `cpu` memory or local
    `disk` (megatron only)."""
    stream_optimizer_state_to_disk: bool = False
    """Keep optimizer state on local disk and stream it in bucket by bucket at the optimizer step
    (to fit, not to go faster)."""
    local_disk: LocalDiskSpec | None = None
    """The node-local directory of `offload: disk` and `streamOptimizerStateToDisk` (hostPath or an
    ephemeral volume per rank pod); unset: a temporary directory inside the container."""
    grad_clip: float = Field(default=1.0, gt=0.0, le=1000000.0)
    """Clip the global gradient norm to this before each optimizer step."""
    micro_batch_size: int = Field(default=64, ge=1, le=1048576)
    """Rows (samples) per forward/backward pass; gradients accumulate over a step's micro-batches."""
