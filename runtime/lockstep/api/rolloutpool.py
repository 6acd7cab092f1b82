"""RolloutPool: the engine replicas of one job behind one router Service.

Why it exists: the pool is the unit that scales (`kubectl scale rolloutpool`, an HPA or KEDA through
the /scale subresource) and that reports, per replica, which weight version it serves. The operator
creates one per RLJob from spec.rollout; users rarely write one by hand.

Who uses it: the operator (creates and reconciles pools, writes status), the driver (reads the
engines' addresses and versions).
"""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import Field

from lockstep.api.common import EMPTY_DEFAULT, NAME_PATTERN, ApiModel, Condition, KubeObject
from lockstep.api.model import ModelSpec
from lockstep.api.placement import PlacementSpec
from lockstep.api.rollout import Autoscaling, EngineSpec, min_available


class PoolRole(enum.StrEnum):
    """What a pool's engines are for."""

    ROLLOUT = "rollout"
    TEACHER = "teacher"


class RolloutPoolSpec(ApiModel):
    """Desired state of a pool of rollout engine replicas."""

    job: str | None = Field(default=None, min_length=1, max_length=63, pattern=NAME_PATTERN)
    """Name of the RLJob the pool serves (the operator sets it on the pools it creates). Unset: a
    standalone pool, created by a user and owned by no job (of role teacher: the OPD teacher of the jobs
    that name it in algorithm.opd.teachers[].poolRef): RLJobs use it through rollout.poolRef,
    each with its own LoRA adapter, and its lifetime and scaling are independent of any of them. A
    standalone pool's model.lora declares the adapters it serves (rank: SGLang's --max-lora-rank;
    targetModules: --lora-target-modules)."""
    replicas: int = Field(default=1, ge=0, le=4096)
    """Desired engine replicas (the /scale subresource writes this)."""
    autoscaling: Autoscaling | None = None
    """Bounds for replicas; unset allows any count."""
    model: ModelSpec
    """The model the engines serve (immutable)."""
    engine: EngineSpec = Field(default_factory=EngineSpec, json_schema_extra=EMPTY_DEFAULT)
    """What each replica runs."""
    placement: PlacementSpec = Field(default_factory=PlacementSpec, json_schema_extra=EMPTY_DEFAULT)
    """Where the replicas go."""
    r3: bool = False
    """Rollout routing replay (the job's algorithm.r3): the engines return the routed experts of
    every token (SGLang --enable-return-routed-experts)."""
    role: PoolRole = PoolRole.ROLLOUT
    """`rollout`: the job's policy, updated every version (engines ready only at the current version,
    the weights-current gate); `teacher`: an on-policy-distillation teacher that jobs only read, never
    updated, ready once it serves: a job's own (spec.algorithm.opd.teachers[].checkpoint) or, with
    spec.job unset, a standalone one that jobs name in teachers[].poolRef (no rollout.poolRef may name
    it; its NetworkPolicy admits their drivers on the HTTP port only)."""
    true_on_policy: bool = False
    """The job's algorithm.trueOnPolicy: the engines run deterministic kernels matched to the FSDP
    trainer (SGLang --enable-deterministic-inference --rl-on-policy-target fsdp)."""

    @property
    def min_available(self) -> int:
        """The engines the pool must have ready (lockstep.api.rollout.min_available)."""
        return min_available(self.replicas, self.autoscaling)


class EngineStatus(ApiModel):
    """One replica as observed."""

    name: str = Field(min_length=1, max_length=253)
    """Pod name of the replica."""
    address: str | None = Field(default=None, max_length=256)
    """`host:port` of its HTTP server."""
    ready: bool = False
    """Whether it passes /health_generate."""
    weight_version: int | None = Field(default=None, ge=0)
    """The weight version it reports."""


class RolloutPoolStatus(ApiModel):
    """Observed state of a pool."""

    replicas: int = Field(default=0, ge=0)
    """Replicas that exist (the /scale subresource reads this)."""
    ready_replicas: int = Field(default=0, ge=0)
    """Replicas ready to serve."""
    selector: str | None = Field(default=None, max_length=1024)
    """Label selector of the replica pods, as a string (for /scale and autoscalers)."""
    weight_version: int | None = Field(default=None, ge=0)
    """The weight version every ready replica holds; unset while they disagree."""
    engines: list[EngineStatus] = Field(default_factory=list, max_length=4096)
    """Per-replica status, including its weight version."""
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """Conditions: Available, MinAvailableBreached, WeightsSynced."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The metadata.generation the status describes."""


class RolloutPool(KubeObject):
    """The rollout engine replicas of one RLJob behind one router, or (spec.job unset) a standalone pool
    several LoRA jobs share; scalable through /scale (`kubectl scale rolloutpool`). The operator creates
    a job's pool from its spec.rollout; a standalone pool is created by a user."""

    api_version: Literal["rl.lockstep.dev/v1alpha1"] = "rl.lockstep.dev/v1alpha1"
    """rl.lockstep.dev/v1alpha1"""
    kind: Literal["RolloutPool"] = "RolloutPool"
    """RolloutPool"""
    spec: RolloutPoolSpec
    """Desired state."""
    status: RolloutPoolStatus | None = None
    """Observed state."""
