"""Helpers shared by the reconciles: the operator's annotations and the write-once status patch.

Why it exists: the RLJob reconcile tells its children things their specs do not carry (suspended,
stopped, the gang's size, the restart limit) through annotations it owns by server-side apply, and
every reconcile writes its status the same way (only when it changed, never kopf bookkeeping).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from lockstep_operator.k8s.client import KubeClient
from lockstep_operator.resources.common import API_VERSION, GROUP

ANN_SUSPENDED = f"{GROUP}/suspended"
"""On pool and trainer: "true" while the job is suspended (no pods; spec.replicas kept)."""
ANN_STOPPED = f"{GROUP}/stopped"
"""On pool and trainer: set once the job finished or failed (pods deleted)."""
ANN_GANG_MIN = f"{GROUP}/gang-min-member"
"""On pool and trainer: the gang's minMember (all trainer rank pods + minimum engine replicas)."""
ANN_RESTART_LIMIT = f"{GROUP}/restart-limit"
"""On the trainer: gang restarts allowed (the RLJob's backoffLimit)."""
ANN_COLOCATE = f"{GROUP}/colocate"
"""On the channel: "true" when trainer and engines share GPUs (schedule.colocate)."""
ANN_SHARED_VOLUME = f"{GROUP}/shared-volume"
"""On pool and trainer: the ReadWriteMany claim mounted at /shared (weightSync.diskDelta.volumeClaim)."""
ANN_JOB_REPLICAS = f"{GROUP}/job-replicas"
"""On the pool: the RLJob's rollout.replicas last copied into pool spec.replicas."""
ANN_CLIQUE = f"{GROUP}/clique"
"""On the trainer: the NVLink domain its ranks were packed into ("" = none)."""
ANN_AVOID_CLIQUE = f"{GROUP}/avoid-clique"
"""On the pool: the trainer's NVLink domain, which engines stay out of ("" = no rule)."""
ANN_CONFIG_HASH = f"{GROUP}/config-hash"
"""On the trainer: hash of the run config the ranks read from job.yaml (reconcile.rljob.run_config_hash);
part of the rank pods' template hash, so an edit of, e.g., the learning rate restarts the gang."""
ANN_QUEUE_HISTORY = f"{GROUP}/queue-history"
"""On the pool: recent [time, step, queueSize, capacity] samples for the autoscaling policy."""
ANN_LAST_SCALED = f"{GROUP}/last-scaled"
"""On the pool: [time, step] of the last autoscaling change."""
ANN_AUTOSCALER = f"{GROUP}/autoscaler"
"""On the pool, set by users: "external" when HPA/KEDA drive /scale (the built-in policy stays off)."""

S = TypeVar("S", bound=BaseModel)


class Wire(Protocol):
    """A lockstep.api status model (it has `wire()`)."""

    def wire(self) -> dict[str, Any]: ...


def annotations_of(body: Mapping[str, Any]) -> dict[str, str]:
    """metadata.annotations of an object ({} when none)."""
    return dict((body.get("metadata") or {}).get("annotations") or {})


def previous_status(body: Mapping[str, Any], model: type[S]) -> S | None:
    """The object's current status parsed, or None when absent or unreadable (then it is rewritten)."""
    raw = body.get("status")
    if not raw:
        return None
    try:
        return model.model_validate(raw)
    except ValidationError:
        return None


async def write_status(kube: KubeClient, body: Mapping[str, Any], previous: Wire | None, new: Wire) -> bool:
    """Patch /status with `new` when it differs from `previous` (the parsed current status).

    Both sides go through the same model, so formatting differences (timestamps) never cause a
    write. Keys the object holds that `new` lacks are cleared. Returns True when written.
    """
    wire = new.wire()
    if previous is not None and previous.wire() == wire:
        return False
    old = body.get("status") or {}
    patch = {"status": {**{k: None for k in old if k not in wire}, **wire}}
    meta = body["metadata"]
    await kube.merge_patch(
        API_VERSION, body["kind"], meta["namespace"], meta["name"], patch, subresource="status"
    )
    return True
