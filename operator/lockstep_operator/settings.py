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
from typing import Any, Literal

from lockstep.api.images import image_ref
from lockstep.api.rljob import GPUProduct
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from lockstep_operator.resources.platforms import (
    DEFAULT_ARCHITECTURES,
    DEFAULT_GPU_PRODUCTS,
    DEFAULT_IMAGE_ARCHITECTURES,
    NodeFacts,
    parse_architectures,
    parse_image_rules,
    parse_products,
)

ENV_PREFIX = "LOCKSTEP_OPERATOR_"
FIELD_MANAGER = "lockstep-operator"


class OperatorSettings(BaseModel):
    """All operator settings; each field is read from LOCKSTEP_OPERATOR_<FIELD NAME IN CAPS>."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    runtime_image: str = image_ref("runtime")
    """Image of the driver and trainer pods when the RLJob spec names none (images/runtime.Dockerfile,
    tagged with the package version)."""
    engine_image: str = image_ref("engine")
    """Image of the rollout engine pods when the RLJob spec names none (images/engine.Dockerfile:
    SGLang's image at the pinned release)."""
    resync_seconds: float = Field(default=60.0, gt=0)
    """Period of the level-triggered re-check of each job and its children (a work-queue timer that
    the job's passes never postpone: docs/operator.md)."""
    apply_refresh_seconds: float = Field(default=600.0, gt=0)
    """How long an unchanged child's apply is trusted (the client's apply cache, k8s/client.py): a pass
    that wants the same manifest again within it sends nothing. A changed manifest is sent at once; a
    child of a watched kind deleted by hand comes back at once (its DELETED event); one of another kind
    (a Service, a NetworkPolicy, RBAC, a ConfigMap) or edited by hand comes back with the first pass
    after this period (docs/operator.md, "The Kubernetes client"). At the resync period, as before,
    every job re-sent its unchanged children each minute (18 requests per job per minute at rest)."""
    cache_relist_seconds: float = Field(default=300.0, gt=0)
    """Period of the read cache's re-list (k8s/relist.py): one LIST per watched kind and namespace drops
    what was deleted while a watch was broken. It also runs about a second after every watch listing."""
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
    reconcile_qps: float = Field(default=50.0, gt=0)
    """Work queue: passes started per second over all objects (token bucket refill)."""
    reconcile_burst: int = Field(default=200, ge=1)
    """Work queue: passes that may start at once before reconcile_qps applies (token bucket size)."""
    max_concurrent_reconciles: int = Field(default=256, ge=1)
    """Work queue: passes running at the same time. Passes mostly wait on the API, whose load the
    client's gate bounds (max_in_flight_requests): a low cap let passes waiting on their ConfigMaps or
    statuses hold the slots that other jobs' pod-creating passes needed (a 50-job burst took 2.3x as
    long with 32)."""
    max_in_flight_requests: int = Field(default=32, ge=1)
    """API requests of the reconciles in flight at once; the waiting ones go by priority, the requests
    on the path to a job's pods first (k8s/gate.py, policy/request_priority.py)."""
    retry_max_seconds: float = Field(default=120.0, gt=0)
    """Work queue: longest pause before a failed pass is retried (the pause doubles from 1 s)."""
    rdma_resource: str = Field(default="rdma/ib", min_length=1, max_length=253)
    """The extended resource of one RDMA NIC, requested by each rank pod of a p2p job (the cluster's
    RDMA device plugin names it: rdma/ib, rdma/rdma_shared_device_a, nvidia.com/mlnxnics, ...)."""
    gpu_products: tuple[str, ...] = DEFAULT_GPU_PRODUCTS
    """spec.placement.gpuProduct -> the node label value nvidia.com/gpu.product, as `PRODUCT=LABEL`
    entries (comma-separated in the environment), e.g. `GB300=NVIDIA-GB300,H100=NVIDIA-H100-80GB-HBM3`
    (what NVIDIA's GPU feature discovery writes). A product left out is not placed by label."""
    image_architectures: tuple[str, ...] = DEFAULT_IMAGE_ARCHITECTURES
    """Which architectures images exist for, as `IMAGE_PREFIX=ARCH|ARCH` entries (comma-separated; the
    longest matching prefix wins), e.g. `ghcr.io/lockstep/=amd64|arm64,registry.example/sglang=amd64`.
    Every pod gets a required node affinity on kubernetes.io/arch from it (resources.platforms)."""
    default_image_architectures: tuple[str, ...] = DEFAULT_ARCHITECTURES
    """Architectures of an image no entry of image_architectures names (comma-separated)."""

    @field_validator("gpu_products")
    @classmethod
    def _products(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        parse_products(value, [p.value for p in GPUProduct if p is not GPUProduct.ANY])
        return value

    @field_validator("image_architectures")
    @classmethod
    def _image_rules(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        parse_image_rules(value)
        return value

    @field_validator("default_image_architectures")
    @classmethod
    def _default_arches(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return parse_architectures(value, "default architectures")

    def node_facts(self) -> NodeFacts:
        """GPU product labels and image architectures, parsed (resources.platforms)."""
        return NodeFacts(
            products=parse_products(self.gpu_products, [p.value for p in GPUProduct]),
            image_rules=parse_image_rules(self.image_architectures),
            default_architectures=tuple(self.default_image_architectures),
        )


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


_LISTS = frozenset({"namespaces", "gpu_products", "image_architectures", "default_image_architectures"})
"""Settings read from a comma-separated list."""


def settings_from_env(env: Mapping[str, str]) -> OperatorSettings:
    """Parse settings from an environment mapping; a bad value raises naming the variable."""
    raw: dict[str, object] = {}
    for name in OperatorSettings.model_fields:
        key = ENV_PREFIX + name.upper()
        if key in env:
            value = env[key]
            raw[name] = tuple(v.strip() for v in value.split(",") if v.strip()) if name in _LISTS else value
    try:
        return OperatorSettings.model_validate(raw)
    except ValidationError as err:
        problems = "; ".join(_problem(env, e) for e in err.errors())
        raise ValueError(f"invalid operator settings: {problems}") from err


def _problem(env: Mapping[str, str], error: Any) -> str:
    """One refused setting, named; a Kubernetes service link (`tcp://IP:PORT`, set in every pod for each
    Service of its namespace) that collides with a setting's name says so and how to stop it."""
    key = f"{ENV_PREFIX}{'.'.join(str(p) for p in error['loc'][:1]).upper()}"
    text = f"{key}: {error['msg']}"
    if str(env.get(key, "")).startswith("tcp://"):
        text += (
            f" ({key}={env[key]} is a Kubernetes service link of a Service named like the operator's"
            " settings: set enableServiceLinks: false in the operator's pod spec, as manifests/ does)"
        )
    return text
