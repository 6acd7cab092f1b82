"""Which of the operator's API requests go first when they queue (k8s/gate.RequestGate; pure).

Why: under a burst of new jobs every pass wants the API server at once, and a job's pods used to wait
behind every other job's ConfigMaps, RBAC, Services, statuses and Events: on two cores, 50 jobs took
8x as long as creating their pods directly. The requests on the path from an applied RLJob to its
pods go first, as each reconcile already orders them within one pass (docs/operator.md, "Reconcile
order"): the pods, the ServiceAccounts admission requires before them, the children whose passes
create them (RolloutPool, TrainerGroup), a gang's PodGroup, and reads (cheap; a pass waiting on one
holds its work-queue slot). Only
creates and server-side applies of those count: a merge patch (a status, the gang-complete
annotation, spec.replicas) comes after the pods exist. The rest follows in arrival order: the
ConfigMaps, the Secret, Services, the WeightChannel, every status, Events, the Roles and
RoleBindings (they grant only the progress ConfigMap, itself not urgent, and a driver's first report
comes after its model is loaded; a refused report is retried, then dropped, never fatal), and the
pods' NetworkPolicies: the namespace's baseline policy (resources.network), applied before any pod
and marked urgent by its caller, keeps a pod closed until its own policy comes. The gate
serves a request that waited too long next whatever its priority (nothing starves).
"""

from __future__ import annotations

URGENT_RESOURCES = frozenset(
    {
        "pods",
        "serviceaccounts",
        "rolloutpools",
        "trainergroups",
        "podgroups",
    }
)
"""Resources (plural, no subresource) whose creates, applies and deletes go first."""

MERGE_PATCH = "application/merge-patch+json"


def urgent(method: str, resource: str, content_type: str = "application/json") -> bool:
    """Whether a request goes before the others: a read, or a write of URGENT_RESOURCES other than a
    merge patch (their subresources, such as pods/status, are not: what waits for them is not pod
    creation; nor is a merge patch, which changes an object that already exists).

    `resource`: the plural with its subresource, e.g. `pods` or `pods/status` (k8s.client's metric label);
    `content_type`: the request body's.
    """
    if method == "GET":
        return True
    return resource in URGENT_RESOURCES and not (method == "PATCH" and content_type == MERGE_PATCH)
