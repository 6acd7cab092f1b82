"""policy.request_priority: the writes on the path to a job's pods and every read go first."""

from __future__ import annotations

import pytest
from lockstep_operator.policy.request_priority import urgent


@pytest.mark.parametrize(
    ("method", "resource", "want"),
    [
        ("PATCH", "pods", True),  # a pod's server-side apply: what a user waits for
        ("DELETE", "pods", True),  # a gang restart, a replaced engine
        ("PATCH", "serviceaccounts", True),  # admission needs them before the pods
        ("POST", "rolloutpools", True),  # the children whose passes create the pods
        ("PATCH", "trainergroups", True),
        ("PATCH", "podgroups", True),  # a gang scheduler holds pods without theirs
        ("PATCH", "networkpolicies", True),  # kept next to the pods
        ("GET", "nodes", True),  # reads: cheap, and a pass waiting on one holds its slot
        ("GET", "discovery", True),
        ("PATCH", "pods/status", False),  # a readiness gate: nothing waits for it to create a pod
        ("PATCH", "rljobs/status", False),
        ("PATCH", "rolloutpools/status", False),
        ("PATCH", "configmaps", False),  # kubelets retry a missing ConfigMap
        ("POST", "secrets", False),
        ("PATCH", "roles", True),
        ("PATCH", "rolebindings", True),
        ("PATCH", "services", False),
        ("PATCH", "weightchannels", False),
        ("POST", "events", False),
        ("PATCH", "events", False),
    ],
)
def test_urgent_table(method: str, resource: str, want: bool) -> None:
    assert urgent(method, resource) is want
