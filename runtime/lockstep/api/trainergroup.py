"""TrainerGroup: the trainer ranks of one job, started and restarted as one gang.

Why it exists: the trainer is a torch.distributed world (nodes x GPUs ranks) that lives and dies
together; a kind of its own lets the operator own its pods, its rendezvous service and its restart
count apart from the pool. The operator creates one per RLJob from spec.trainer.

Who uses it: the operator (creates, reconciles, writes status), the trainer ranks (read their spec).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lockstep.api.common import EMPTY_DEFAULT, NAME_PATTERN, ApiModel, Condition, KubeObject
from lockstep.api.model import ModelSpec
from lockstep.api.placement import PlacementSpec
from lockstep.api.trainer import TrainerSpec


class TrainerGroupSpec(ApiModel):
    """Desired state of a trainer gang."""

    job: str = Field(min_length=1, max_length=63, pattern=NAME_PATTERN)
    """Name of the RLJob the trainer belongs to."""
    model: ModelSpec
    """The model trained (immutable)."""
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, json_schema_extra=EMPTY_DEFAULT)
    """Backend, size, parallelism, precision, offload (backend immutable)."""
    placement: PlacementSpec = Field(default_factory=PlacementSpec, json_schema_extra=EMPTY_DEFAULT)
    """Where the ranks go."""
    preemption_grace_seconds: int = Field(default=120, ge=10, le=3600)
    """The job's spec.schedule.preemptionGraceSeconds: the rank pods' terminationGracePeriodSeconds,
    the time rank 0 has after SIGTERM to finish its command and write the checkpoint the driver asks for."""


class TrainerGroupStatus(ApiModel):
    """Observed state of a trainer gang."""

    world_size: int | None = Field(default=None, ge=0)
    """Ranks in the torch.distributed world (nodes x gpusPerNode)."""
    ready_ranks: int = Field(default=0, ge=0)
    """Ranks whose pods are running and ready."""
    step: int | None = Field(default=None, ge=0)
    """Optimizer steps done."""
    restarts: int = Field(default=0, ge=0)
    """Times the whole gang was restarted."""
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """Conditions: Available, Degraded, Failed, UpToDate (reason SpecChanged while ranks restart for an edited spec)."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The metadata.generation the status describes."""


class TrainerGroup(KubeObject):
    """The trainer ranks of one RLJob, started and restarted as one gang. Created by the operator
    from the job's spec.trainer."""

    api_version: Literal["rl.lockstep.dev/v1alpha1"] = "rl.lockstep.dev/v1alpha1"
    """rl.lockstep.dev/v1alpha1"""
    kind: Literal["TrainerGroup"] = "TrainerGroup"
    """TrainerGroup"""
    spec: TrainerGroupSpec
    """Desired state."""
    status: TrainerGroupStatus | None = None
    """Observed state."""
