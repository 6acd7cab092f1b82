"""Operator settings, read from the environment once at start-up.

Why it exists: every knob of the operator process (images of the runtime roles, the resync period,
ports of probes and metrics, HA mode) lives in one typed, validated object instead of `os.environ`
lookups scattered through handlers. A wrong value fails at start with the variable's name.

Who calls it: `lockstep_operator.__main__` (process wiring) and `lockstep_operator.handlers` (passes it to
the reconcile functions); tests build `OperatorSettings(...)` directly.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from functools import lru_cache
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENV_PREFIX = "LOCKSTEP_OPERATOR_"
FIELD_MANAGER = "lockstep-operator"


class OperatorSettings(BaseModel):
    """All operator settings; each field is read from LOCKSTEP_OPERATOR_<FIELD NAME IN CAPS>."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    runtime_image: str = "ghcr.io/lockstep/lockstep-runtime:0.1.0"
    """Image of the driver and trainer pods when the RLJob spec names none (`pip install .[runtime]`)."""
    engine_image: str = "ghcr.io/lockstep/lockstep-engine:0.1.0"
    """Image of the rollout engine pods when the RLJob spec names none (based on SGLang's image)."""
    resync_seconds: float = Field(default=60.0, gt=0)
    """Period of the level-triggered re-check of every object (kopf timer)."""
    namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty = cluster-wide. From a comma-separated list."""
    ha_mode: Literal["standalone", "peering"] = "peering"
    """peering: several replicas, one active (kopf peering, highest priority wins); standalone: one replica."""
    peering_name: str = "lockstep-operator"
    """Name of the kopf ClusterKopfPeering/KopfPeering object used for HA."""
    peering_lifetime_seconds: int = Field(default=60, ge=1, le=3600)
    """How long a replica's peering record counts as alive (kopf settings.peering.lifetime). A replica
    renews it slightly earlier (lifetime - 5..10 s, at least every second); when the active replica
    dies, a standby takes over within about this long. Tests use a few seconds."""
    priority: int | None = None
    """This replica's peering priority (higher wins, lower ones pause). Unset: derived from $POD_NAME, so
    the replicas of one Deployment get distinct priorities and exactly one is active."""
    health_port: int = Field(default=8080, ge=0, le=65535)
    """Port of the liveness/readiness endpoint (/healthz); 0 disables it."""
    metrics_port: int = Field(default=9090, ge=0, le=65535)
    """Port of the Prometheus /metrics endpoint; 0 disables it."""
    log_format: Literal["json", "text"] = "json"
    """json: one JSON object per line (structured logs); text: kopf's plain format."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Root log level."""
    autoscale_window_seconds: float = Field(default=120.0, gt=0)
    """Built-in pool autoscaler: how long the queue must stay near zero / at capacity before acting."""
    autoscale_cooldown_seconds: float = Field(default=300.0, ge=0)
    """Built-in pool autoscaler: minimum time between two changes of a pool."""
    gang_restart_limit_default: int = Field(default=3, ge=0)
    """Gang restarts of a TrainerGroup allowed when its spec does not say."""
    rdma_resource: str = Field(default="rdma/ib", min_length=1, max_length=253)
    """The extended resource of one RDMA NIC, requested by each rank pod of a p2p job (the cluster's
    RDMA device plugin names it: rdma/ib, rdma/rdma_shared_device_a, nvidia.com/mlnxnics, ...)."""


def effective_priority(settings: OperatorSettings, pod_name: str | None) -> int:
    """The peering priority: the setting, else a stable number in [1, 2**32] from the pod name.

    Two replicas of equal priority both pause (kopf's rule), so the range is the whole crc32 space:
    two pod names collide with a chance of about 1 in 4e9.
    """
    if settings.priority is not None:
        return settings.priority
    if not pod_name:
        return 0
    return 1 + zlib.crc32(pod_name.encode())


@lru_cache(maxsize=1)
def load_settings() -> OperatorSettings:
    """The process-wide settings, parsed once from os.environ."""
    return settings_from_env(os.environ)


def settings_from_env(env: Mapping[str, str]) -> OperatorSettings:
    """Parse settings from an environment mapping; a bad value raises naming the variable."""
    raw: dict[str, object] = {}
    for name in OperatorSettings.model_fields:
        key = ENV_PREFIX + name.upper()
        if key in env:
            value = env[key]
            raw[name] = (
                tuple(v.strip() for v in value.split(",") if v.strip()) if name == "namespaces" else value
            )
    try:
        return OperatorSettings.model_validate(raw)
    except ValidationError as err:
        problems = "; ".join(
            f"{ENV_PREFIX}{'.'.join(str(p) for p in e['loc'][:1]).upper()}: {e['msg']}" for e in err.errors()
        )
        raise ValueError(f"invalid operator settings: {problems}") from err
