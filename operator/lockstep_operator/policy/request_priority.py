"""Which of the operator's API requests go first when they queue (k8s/gate.RequestGate; pure).

Why: under a burst of new jobs every pass wants the API server at once, and a job's pods used to wait
behind every other job's ConfigMaps, RBAC, Services, statuses and Events: on two cores, 50 jobs took
8x as long as creating their pods directly. The requests on the path from an applied RLJob to its
pods go first, as each reconcile already orders them within one pass (docs/operator.md, "Reconcile
order"): the pods, the ServiceAccounts admission requires before them, the children whose passes
create them (RolloutPool, TrainerGroup), a gang's PodGroup, the pods' NetworkPolicies (kept next to
the pods, as before), the Role and RoleBinding a pod needs from its first second, and reads (cheap;
a pass waiting on one holds its work-queue slot). The rest
(ConfigMaps, the Secret, Services, the WeightChannel, every status, Events) follows in arrival
order; the gate serves a request that waited too long next whatever its priority (nothing starves).
"""

from __future__ import annotations

URGENT_RESOURCES = frozenset(
    {
        "pods",
        "serviceaccounts",
        "roles",
        "rolebindings",
        "rolloutpools",
        "trainergroups",
        "podgroups",
        "networkpolicies",
    }
)
"""Resources (plural, no subresource) whose writes go first."""


def urgent(method: str, resource: str) -> bool:
    """Whether a request goes before the others: a read, or a write of URGENT_RESOURCES (their
    subresources, such as pods/status, are not: what waits for them is not pod creation).

    `resource`: the plural with its subresource, e.g. `pods` or `pods/status` (k8s.client's metric label).
    """
    return method == "GET" or resource in URGENT_RESOURCES
