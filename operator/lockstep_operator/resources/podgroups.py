"""Gang scheduling: the pod group object and per-pod keys for Volcano, Kueue and scheduler-plugins.

Why it exists: a job whose trainer ranks are placed but whose engines wait (or the reverse) holds GPUs
and makes no progress. All gang members (every trainer rank + the pool's min_available engines) go
into ONE group, since no scheduler gang-schedules across groups; engines above the minimum come and
go with autoscaling, and the CPU-only driver is not a member. The keys of each scheduler (PodGroup
APIs, pod labels and annotations, scheduler names) are listed in docs/operator.md, "Placement and
gang scheduling". Called by the RLJob reconcile (the group object, after checking with `group_api`
that the scheduler's API is served) and the engine and rank builders (the member keys).
"""

from __future__ import annotations

from typing import Literal

from lockstep.api.rljob import RLJobSpec, TrainingRecipe

from lockstep_operator.resources.common import Manifest, Owner, gang_name, job_labels, metadata
from lockstep_operator.resources.pods import Gang

Scheduler = Literal["none", "volcano", "kueue", "scheduler-plugins"]

GROUP_API: dict[str, tuple[str, str]] = {
    "volcano": ("scheduling.volcano.sh/v1beta1", "PodGroup"),
    "scheduler-plugins": ("scheduling.x-k8s.io/v1alpha1", "PodGroup"),
    "kueue": ("kueue.x-k8s.io/v1beta1", "Workload"),
}
"""(apiVersion, kind) whose presence proves the scheduler is installed; kueue creates Workloads itself."""
SCHEDULER_NAMES = {"volcano": "volcano", "scheduler-plugins": "scheduler-plugins-scheduler"}


def gang_min_member(spec: RLJobSpec) -> int:
    """All trainer rank pods + the pool's min_available engines (one PodGroup holds every member); a
    job on a standalone pool (rollout.poolRef) has no engines of its own in the gang."""
    no_pool = spec.rollout.pool_ref is not None or spec.recipe is TrainingRecipe.SFT  # an SFT job: none
    engines = 0 if no_pool else spec.rollout.min_available
    return int(spec.trainer.nodes) + engines


def group_api(scheduler: Scheduler) -> tuple[str, str] | None:
    """The API to check for before using `scheduler`; None for "none"."""
    return GROUP_API.get(scheduler)


def pod_group(
    owner: Owner, *, job: str, scheduler: Scheduler, min_member: int, queue: str | None, timeout_s: int = 600
) -> Manifest | None:
    """The PodGroup object for Volcano or scheduler-plugins; None for kueue and none."""
    if scheduler not in ("volcano", "scheduler-plugins"):
        return None
    api_version, kind = GROUP_API[scheduler]
    spec: Manifest = {"minMember": min_member}
    if scheduler == "volcano" and queue:
        spec["queue"] = queue
    if scheduler == "scheduler-plugins":
        spec["scheduleTimeoutSeconds"] = timeout_s
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": metadata(owner, gang_name(job), job_labels(job)),
        "spec": spec,
    }


def member_keys(*, job: str, scheduler: Scheduler, min_member: int, queue: str | None, member: bool) -> Gang:
    """What a pod carries; `member` False for pods outside the gang (engines above the minimum)."""
    group = gang_name(job)
    if scheduler == "volcano":
        return Gang(SCHEDULER_NAMES["volcano"], {}, {"scheduling.k8s.io/group-name": group} if member else {})
    if scheduler == "scheduler-plugins":
        labels = {"scheduling.x-k8s.io/pod-group": group} if member else {}
        return Gang(SCHEDULER_NAMES["scheduler-plugins"], labels, {})
    if scheduler == "kueue":
        labels = {"kueue.x-k8s.io/queue-name": queue} if queue else {}
        if not member:
            return Gang(None, labels, {})
        labels["kueue.x-k8s.io/pod-group-name"] = group
        return Gang(None, labels, {"kueue.x-k8s.io/pod-group-total-count": str(min_member)})
    return Gang()
