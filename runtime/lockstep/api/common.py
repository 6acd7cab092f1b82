"""Shared pieces of the Lockstep API: the base model, object metadata, conditions, group/version.

Why it exists: the four kinds (RLJob, RolloutPool, TrainerGroup, WeightChannel) share one wire
convention (camelCase fields, unknown fields refused, every field documented) and the Kubernetes
status vocabulary (conditions, observedGeneration). Defining them once keeps the generated CRDs and
the Python models in step.

Who uses it: the kind modules of lockstep.api, lockstep.api.crdgen (the docstrings below become CRD
descriptions), the operator (it reads and writes these models) and the runtime (it loads manifests).
"""

from __future__ import annotations

import datetime as dt
import enum
from typing import Annotated, Any, Final

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP: Final = "rl.lockstep.dev"
"""The API group of every Lockstep kind."""
VERSION: Final = "v1alpha1"
"""The one served and stored version."""
API_VERSION: Final = f"{GROUP}/{VERSION}"
"""The apiVersion string of every Lockstep object."""

EMPTY_DEFAULT: Final[dict[str, Any]] = {"default": {}}
"""json_schema_extra for a section that is always present: the apiserver fills `{}` and then the
section's own defaults, exactly as pydantic's default_factory does, so CEL rules and Python see the
same object."""

NAME_PATTERN: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
"""A DNS-1123 label: lowercase letters, digits and '-', starting and ending alphanumeric."""
IMPORT_PATH_PATTERN: Final = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$"
"""A Python import path `package.module:function`."""

# Bounded strings inside lists and maps: the apiserver estimates CEL cost from these bounds.
Label = Annotated[str, Field(max_length=63)]


class ApiModel(BaseModel):
    """Base of every spec and status model: camelCase on the wire, unknown fields refused.

    Python code uses snake_case attribute names; manifests and the cluster use the camelCase aliases
    (Kubernetes convention). Both are accepted on input (populate_by_name).
    """

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        populate_by_name=True,
        alias_generator=to_camel,
        validate_default=False,
    )

    def wire(self) -> dict[str, Any]:
        """The camelCase JSON form, unset optional fields left out (what the apiserver stores)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class ObjectMeta(BaseModel):
    """The part of Kubernetes object metadata that Lockstep reads.

    Kubernetes owns metadata and adds many fields (managedFields, ownerReferences, ...), so unknown
    fields are kept rather than refused; the apiserver validates metadata itself.
    """

    model_config = ConfigDict(
        extra="allow", use_attribute_docstrings=True, populate_by_name=True, alias_generator=to_camel
    )

    name: str = Field(min_length=1, max_length=253)
    """Object name. Lockstep kinds need a DNS-1123 label (rule `name-is-a-label`), since it prefixes
    the names of the pods and services of the job."""
    namespace: str | None = None
    """Namespace; None in a manifest file means the current namespace."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Labels, copied onto the children the operator creates."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Annotations."""
    generation: int | None = None
    """Set by the apiserver; bumps on every spec change (compare with status.observedGeneration)."""
    uid: str | None = None
    """Set by the apiserver; used for owner references."""
    resource_version: str | None = None
    """Set by the apiserver; optimistic concurrency token."""
    creation_timestamp: dt.datetime | None = None
    """Set by the apiserver at creation."""


class ConditionStatus(enum.StrEnum):
    """Status of a condition, as in metav1.Condition."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(ApiModel):
    """One observation about the object, in the shape of Kubernetes metav1.Condition.

    Conditions form a map keyed by type: at most one condition per type.
    """

    type: str = Field(
        min_length=1,
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
    )
    """Condition type in CamelCase, e.g. Admitted, PreflightPassed, WeightChannelReady, Progressing,
    Degraded, Suspended, Complete, Failed (jobs) or Available, WeightsSynced (pools)."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    """A CamelCase machine-readable reason for the last transition."""
    message: str = Field(default="", max_length=32768)
    """A human-readable message about the transition; may be empty."""
    last_transition_time: dt.datetime
    """When the status last changed (RFC 3339)."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The metadata.generation this condition was computed from."""


class PoolRef(ApiModel):
    """A RolloutPool in the job's namespace, by name."""

    name: str = Field(min_length=1, max_length=63, pattern=NAME_PATTERN)
    """The RolloutPool's metadata.name."""


class KubeObject(ApiModel):
    """Base of the four kinds: the part every Kubernetes object has.

    Rules on the whole object (the name, lockstep.api.rules) sit here; crdgen puts them at the root
    of each CRD schema.
    """

    metadata: ObjectMeta
    """Object metadata."""
