"""spec.placement: where a job's pods go (GPU product, node selector, tolerations, gang scheduling).

Why it exists: placement is shared by RLJob, RolloutPool and TrainerGroup; it is declared once here.

Who uses it: lockstep.api.rljob (RLJobSpec.placement), lockstep.api.rolloutpool,
lockstep.api.trainergroup, the operator (pod scheduling and the gang).
"""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import Field

from lockstep.api.common import EMPTY_DEFAULT, ApiModel, Label


class GPUProduct(enum.StrEnum):
    """GPU product the pods need (matched on nvidia.com/gpu.product)."""

    GB300 = "GB300"
    H100 = "H100"
    ANY = "any"


class GangSchedulerName(enum.StrEnum):
    """Which gang scheduler admits the job's pods all at once."""

    NONE = "none"
    VOLCANO = "volcano"
    KUEUE = "kueue"
    SCHEDULER_PLUGINS = "scheduler-plugins"


class Toleration(ApiModel):
    """A Kubernetes toleration."""

    key: str | None = Field(default=None, max_length=316)
    """Taint key; unset with operator Exists matches every taint."""
    operator: Literal["Equal", "Exists"] = "Equal"
    """Equal or Exists."""
    value: str | None = Field(default=None, max_length=63)
    """Taint value for Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; unset matches all."""
    toleration_seconds: int | None = Field(default=None, ge=0)
    """For NoExecute: how long the pod stays bound after the taint appears."""


class GangScheduling(ApiModel):
    """Gang scheduling of all pods of the job as one group."""

    scheduler: GangSchedulerName = GangSchedulerName.NONE
    """`none`, `volcano`, `kueue` or `scheduler-plugins` (coscheduling)."""
    queue_name: str | None = Field(default=None, max_length=253)
    """Queue of the scheduler (required for kueue)."""


class PlacementSpec(ApiModel):
    """Where the pods go."""

    gpu_product: GPUProduct = GPUProduct.ANY
    """GPU product: `GB300`, `H100` or `any`."""
    node_selector: dict[str, Label] = Field(default_factory=dict, max_length=32)
    """Extra node labels every pod requires."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Tolerations of every pod."""
    gang: GangScheduling = Field(default_factory=GangScheduling, json_schema_extra=EMPTY_DEFAULT)
    """Gang scheduler integration."""
