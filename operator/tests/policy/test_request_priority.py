"""policy.request_priority: the writes on the path to a job's pods and every read go first."""

from __future__ import annotations

import pytest
from lockstep_operator.policy.request_priority import MERGE_PATCH, urgent

APPLY = "application/apply-patch+yaml"
JSON = "application/json"


@pytest.mark.parametrize(
    ("method", "resource", "content_type", "want"),
    [
        ("PATCH", "pods", APPLY, True),  # a pod's server-side apply: what a user waits for
        ("DELETE", "pods", JSON, True),  # a gang restart, a replaced engine
        ("PATCH", "serviceaccounts", APPLY, True),  # admission needs them before the pods
        ("POST", "rolloutpools", JSON, True),  # the children whose passes create the pods
        ("PATCH", "trainergroups", APPLY, True),
        ("PATCH", "podgroups", APPLY, True),  # a gang scheduler holds pods without theirs
        ("GET", "nodes", JSON, True),  # reads: cheap, and a pass waiting on one holds its slot
        ("GET", "discovery", JSON, True),
        ("PATCH", "pods/status", APPLY, False),  # a readiness gate: nothing waits for it to create a pod
        ("PATCH", "rljobs/status", MERGE_PATCH, False),
        ("PATCH", "rolloutpools/status", MERGE_PATCH, False),
        ("PATCH", "configmaps", APPLY, False),  # kubelets retry a missing ConfigMap
        ("POST", "secrets", JSON, False),
        ("PATCH", "roles", APPLY, False),  # they grant only the progress ConfigMap, itself not urgent
        ("PATCH", "rolebindings", APPLY, False),
        ("PATCH", "networkpolicies", APPLY, False),  # the namespace's baseline closes the pods until then
        ("PATCH", "services", APPLY, False),
        ("PATCH", "weightchannels", APPLY, False),
        ("POST", "events", JSON, False),
        ("PATCH", "events", APPLY, False),
        ("PATCH", "trainergroups", MERGE_PATCH, False),  # the gang-complete annotation: after the pods
        ("PATCH", "rolloutpools", MERGE_PATCH, False),  # spec.replicas: one request, not a burst's
        ("PATCH", "pods", MERGE_PATCH, False),  # an existing pod's label
    ],
)
def test_urgent_table(method: str, resource: str, content_type: str, want: bool) -> None:
    assert urgent(method, resource, content_type) is want
