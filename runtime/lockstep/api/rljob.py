"""RLJob: the user's whole interface to one RL post-training run.

Why it exists: a job is a model, an algorithm, a rollout pool, a trainer, a way to sync weights, a
schedule, data, an agent and a placement. This module declares the job itself (its spec, status and
phase) with the defaults of the Miles v0.1 design (docs/design.md) and a documented meaning per field;
lockstep.api.crdgen turns it into the CRD (so `kubectl explain rljob.spec.rollout` reads these
docstrings) and lockstep.api.rules adds the cross-field checks. Each section lives in its own module,
since the child kinds RolloutPool, TrainerGroup and WeightChannel reuse them: lockstep.api.model,
.algorithm, .rollout, .trainer, .weightsync, .schedule, .data (data and agent) and .placement. This
module re-exports their names, so `from lockstep.api.rljob import TrainerSpec` keeps working.

Who uses it: `lockstep run` and `lockstep validate` (through load_manifest), the driver and the
trainer (they read the typed spec), the operator (it reconciles RLJobs into children and writes the
status).
"""

from __future__ import annotations

import datetime as dt
import enum
from typing import Literal

from pydantic import Field

from lockstep.api.algorithm import (
    TEACHER_URLS_ENV,
    AdvantageEstimator,
    AlgorithmSpec,
    CandidateSet,
    CandidatesSpec,
    CandidateWeight,
    DynamicSamplingSpec,
    KLEstimator,
    KLSpec,
    LRDecay,
    LRScheduleSpec,
    MismatchCorrection,
    MismatchSpec,
    OPDSpec,
    SFTWarmStartSpec,
    TaskReward,
    Teacher,
    teacher_api_key_env,
    teacher_pool_name,
)
from lockstep.api.common import EMPTY_DEFAULT, ApiModel, Condition, KubeObject, Label, PoolRef
from lockstep.api.data import AgentSpec, DataSpec
from lockstep.api.model import HUB_ID_PATTERN, LoraSpec, ModelSpec, SecretKeySelector, is_hub_id
from lockstep.api.placement import GangSchedulerName, GangScheduling, GPUProduct, PlacementSpec, Toleration
from lockstep.api.rollout import (
    Autoscaling,
    Engine,
    EngineSpec,
    KVCacheDtype,
    Matcher,
    Precision,
    RolloutSpec,
    SamplingSpec,
    SessionMode,
    SessionSpec,
    min_available,
)
from lockstep.api.sandbox import SandboxSpec
from lockstep.api.schedule import ScheduleMode, ScheduleSpec
from lockstep.api.trainer import (
    Device,
    LocalDiskSource,
    LocalDiskSpec,
    Offload,
    Parallelism,
    TrainerBackend,
    TrainerSpec,
)
from lockstep.api.weightsync import (
    Checksum,
    DeltaEncoding,
    DiskDeltaSpec,
    PauseMode,
    Transport,
    WeightSyncSpec,
)

__all__ = [
    "HUB_ID_PATTERN",
    "TEACHER_URLS_ENV",
    "AdvantageEstimator",
    "AgentSpec",
    "AlgorithmSpec",
    "Autoscaling",
    "CandidateSet",
    "CandidateWeight",
    "CandidatesSpec",
    "Checksum",
    "DataSpec",
    "DeltaEncoding",
    "Device",
    "DiskDeltaSpec",
    "DynamicSamplingSpec",
    "Engine",
    "EngineSpec",
    "GPUProduct",
    "GangSchedulerName",
    "GangScheduling",
    "KLEstimator",
    "KLSpec",
    "KVCacheDtype",
    "LRDecay",
    "LRScheduleSpec",
    "Label",
    "LocalDiskSource",
    "LocalDiskSpec",
    "LoraSpec",
    "Matcher",
    "MismatchCorrection",
    "MismatchSpec",
    "ModelSpec",
    "OPDSpec",
    "Offload",
    "Parallelism",
    "PauseMode",
    "Phase",
    "PlacementSpec",
    "PoolRef",
    "Precision",
    "RLJob",
    "RLJobSpec",
    "RLJobStatus",
    "RolloutSpec",
    "SFTWarmStartSpec",
    "SamplingSpec",
    "SandboxSpec",
    "ScheduleMode",
    "ScheduleSpec",
    "SecretKeySelector",
    "SessionMode",
    "SessionSpec",
    "TaskReward",
    "Teacher",
    "Toleration",
    "TrainerBackend",
    "TrainerSpec",
    "TrainingRecipe",
    "Transport",
    "WeightSyncSpec",
    "is_hub_id",
    "min_available",
    "standalone_teachers",
    "teacher_api_key_env",
    "teacher_pool_name",
]


class TrainingRecipe(enum.StrEnum):
    """What kind of post-training a job runs."""

    RL = "rl"
    SFT = "sft"


class RLJobSpec(ApiModel):
    """Desired state of an RL post-training job."""

    recipe: TrainingRecipe = TrainingRecipe.RL
    """`rl` (rollout engines, rewards, the RL loop; with algorithm.opd, distillation) or `sft`: supervised
    fine-tuning on data.prompts' prompt/response or messages rows, loss on assistant tokens only (the mask
    from the checkpoint's own chat template), with the same trainer, parallelism, checkpoints, metrics and
    status but no engines: no RolloutPool, no WeightChannel (docs/distillation.md). algorithm.batchSize
    counts rows per step."""
    model: ModelSpec
    """The policy model (immutable)."""
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, json_schema_extra=EMPTY_DEFAULT)
    """The objective: advantages, group size, batch, learning rate, KL, mismatch correction, R3,
    true-on-policy, OPD."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, json_schema_extra=EMPTY_DEFAULT)
    """Rollout engines, sampling and the session server."""
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, json_schema_extra=EMPTY_DEFAULT)
    """The trainer (backend immutable)."""
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec, json_schema_extra=EMPTY_DEFAULT)
    """How weights reach the engines."""
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec, json_schema_extra=EMPTY_DEFAULT)
    """Sync or fully-async, colocation, staleness bound, steps, save and eval intervals."""
    data: DataSpec
    """Prompt source."""
    agent: AgentSpec = Field(default_factory=AgentSpec, json_schema_extra=EMPTY_DEFAULT)
    """User agent, generate and reward functions."""
    placement: PlacementSpec = Field(default_factory=PlacementSpec, json_schema_extra=EMPTY_DEFAULT)
    """Node selection and gang scheduling."""
    suspend: bool = False
    """Suspend the job: pods are deleted, progress is kept (Kueue sets this)."""
    active_deadline_seconds: int | None = Field(default=None, ge=1, le=31536000)
    """Fail the job when it has run this long."""
    backoff_limit: int = Field(default=3, ge=0, le=1000)
    """Restarts (from the last checkpoint) before the job fails."""


class Phase(enum.StrEnum):
    """Where a job is in its life."""

    PENDING = "Pending"
    PROVISIONING = "Provisioning"
    PREFLIGHT = "Preflight"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class RLJobStatus(ApiModel):
    """Observed state of an RL job, written by the operator and the driver."""

    phase: Phase | None = None
    """Pending, Provisioning, Preflight, Running, Suspended, Succeeded or Failed."""
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """Conditions: Admitted, PreflightPassed, WeightChannelReady, Progressing, Degraded, Suspended,
    Complete, Failed."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The metadata.generation the status describes."""
    step: int | None = Field(default=None, ge=0)
    """Optimizer steps done."""
    weight_version: int | None = Field(default=None, ge=0)
    """The weight version all engines hold."""
    reward: float | None = None
    """Moving average of the raw reward."""
    staleness: int | None = Field(default=None, ge=0)
    """Largest staleness S_old (versions) of the groups of the last step."""
    avg_staleness: float | None = Field(default=None, ge=0.0)
    """Token-weighted mean staleness of the last step."""
    queue_size: int | None = Field(default=None, ge=0)
    """Complete groups waiting in the buffer."""
    transport: str | None = Field(default=None, max_length=32)
    """The weight transport in use."""
    transport_reason: str | None = Field(default=None, max_length=1024)
    """Why that transport was chosen."""
    restarts: int | None = Field(default=None, ge=0)
    """Restarts so far."""
    sandbox_aborts: int | None = Field(default=None, ge=0)
    """Samples aborted because their sandbox failed, timed out or could not be claimed (since the
    driver started; spec.agent.sandbox). The job goes on; a step in which every sample failed fails it."""
    start_time: dt.datetime | None = None
    """When the job started running."""
    completion_time: dt.datetime | None = None
    """When the job succeeded or failed."""


class RLJob(KubeObject):
    """An RL post-training job: the policy model, how it samples (rollout), learns (algorithm,
    trainer), moves weights (weightSync) and loops (schedule). The operator runs it as a RolloutPool,
    a TrainerGroup and a WeightChannel; `lockstep run` runs it on one machine."""

    api_version: Literal["rl.lockstep.dev/v1alpha1"] = "rl.lockstep.dev/v1alpha1"
    """rl.lockstep.dev/v1alpha1"""
    kind: Literal["RLJob"] = "RLJob"
    """RLJob"""
    spec: RLJobSpec
    """Desired state: model, algorithm, rollout, trainer, weightSync, schedule, data, agent, placement."""
    status: RLJobStatus | None = None
    """Observed state, written by the operator and the driver."""


def standalone_teachers(spec: RLJobSpec) -> dict[str, str]:
    """Teacher name -> the standalone RolloutPool serving it, for the poolRef teachers of
    spec.algorithm.opd (pure; {} without OPD)."""
    opd = spec.algorithm.opd
    teachers = opd.teachers if opd is not None else []
    return {t.name: t.pool_ref.name for t in teachers if t.pool_ref is not None}
