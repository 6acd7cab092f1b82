"""WeightChannel: the path a weight version takes from a TrainerGroup to a RolloutPool.

Why it exists: the transport (broadcast, p2p, disk-delta, cuda-ipc) is a choice of topology with its
own resources (an NCCL group, registered buffers, a shared volume) and its own health (preflight,
last published version, bytes on the wire). A kind of its own makes that choice and its reason
visible (`kubectl get wch`) and lets it be re-established when the pool scales.

Who uses it: the operator (creates it from spec.weightSync and the chosen transport, writes status),
the driver and the weight transports (read it, report versions).
"""

from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import Field

from lockstep.api.common import EMPTY_DEFAULT, NAME_PATTERN, ApiModel, Condition, KubeObject
from lockstep.api.weightsync import Transport, WeightSyncSpec


class WeightChannelSpec(ApiModel):
    """Desired state of a weight channel."""

    job: str = Field(min_length=1, max_length=63, pattern=NAME_PATTERN)
    """Name of the RLJob."""
    trainer_group: str = Field(min_length=1, max_length=63, pattern=NAME_PATTERN)
    """Name of the source TrainerGroup."""
    rollout_pool: str = Field(min_length=1, max_length=63, pattern=NAME_PATTERN)
    """Name of the target RolloutPool."""
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec, json_schema_extra=EMPTY_DEFAULT)
    """Transport settings, as in the job."""


class WeightChannelStatus(ApiModel):
    """Observed state of a weight channel."""

    transport: Transport | None = None
    """The transport in use (never `auto` once chosen)."""
    reason: str | None = Field(default=None, max_length=1024)
    """Why this transport was chosen."""
    weight_version: int | None = Field(default=None, ge=0)
    """Last version delivered to every engine."""
    last_update_seconds: float | None = Field(default=None, ge=0.0)
    """Wall time of the last update, pause to continue."""
    wire_bytes: int | None = Field(default=None, ge=0)
    """Bytes that crossed the wire or hit the shared disk in the last update."""
    last_update_phases: dict[str, float] | None = Field(default=None, max_length=32)
    """Seconds of the last update per phase (gather, convert, quantize, bucket, encode, transfer,
    patch, engine_load, commit, pause, resume, membership, other); they sum to lastUpdateSeconds."""
    last_update_fallback: str | None = Field(default=None, max_length=32)
    """The transport that delivered the last update because the chosen one failed; unset otherwise."""
    update_fallbacks: int | None = Field(default=None, ge=0)
    """Updates a fallback transport delivered (the Degraded condition says which and why)."""
    last_update_slowest: str | None = Field(default=None, max_length=64)
    """The phase the last update spent most time in and its share, e.g. `transfer 62%`."""
    last_update_time: dt.datetime | None = None
    """When the last update finished."""
    preflight_passed: bool | None = None
    """Result of the weight-equality preflight; unset when not run."""
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """Conditions: Ready, RequestedTransportFeasible, PreflightPassed, Degraded (the last update went
    over a fallback transport)."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The metadata.generation the status describes."""


class WeightChannel(KubeObject):
    """How weight versions travel from a TrainerGroup to a RolloutPool (broadcast, p2p, disk-delta,
    cuda-ipc), with the chosen transport, why, and the last version delivered. Created by the operator."""

    api_version: Literal["rl.lockstep.dev/v1alpha1"] = "rl.lockstep.dev/v1alpha1"
    """rl.lockstep.dev/v1alpha1"""
    kind: Literal["WeightChannel"] = "WeightChannel"
    """WeightChannel"""
    spec: WeightChannelSpec
    """Desired state."""
    status: WeightChannelStatus | None = None
    """Observed state."""
