"""The operator's rights over agent-sandbox objects are exactly what it and the drivers use.

The operator applies each sandbox job's SandboxTemplate and SandboxWarmPool (server-side apply: create
and patch) and grants the driver a Role of CLAIM_RULES, which it may only do while holding every one
of them itself (RBAC refuses to grant more than the granter has, without `escalate`). So
manifests/rbac.yaml must hold CLAIM_RULES and the apply verbs, and nothing else in agent-sandbox's
groups. (e2e/test_operator_manifests.py asks the API server the same as SubjectAccessReviews.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from lockstep.api import load_manifest
from lockstep_operator.resources.common import Owner
from lockstep_operator.resources.sandbox import (
    CLAIM_RULES,
    EXTENSIONS_API,
    SANDBOX_API_GROUP,
    sandbox_manifests,
)

ROOT = Path(__file__).resolve().parents[2]
GROUPS = {EXTENSIONS_API.split("/")[0], SANDBOX_API_GROUP}
APPLY_VERBS = {"create", "patch"}
"""What a server-side apply needs: patch, and create when the object does not exist yet."""

Grant = set[tuple[str, str, str]]
"""(API group, resource, verb) triples."""


def _triples(rules: Any) -> Grant:
    return {
        (g, r, v)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def _cluster_role() -> Grant:
    docs = yaml.safe_load_all((ROOT / "manifests" / "rbac.yaml").read_text())
    (role,) = [d for d in docs if d and d["kind"] == "ClusterRole"]
    return _triples(role["rules"])


def _sandbox_job() -> tuple[list[Any], Grant]:
    """The children of examples/tiny-sandbox.yaml and the triples of its driver's Role."""
    job = load_manifest(ROOT / "examples" / "tiny-sandbox.yaml")
    owner = Owner(api_version="rl.lockstep.dev/v1alpha1", kind="RLJob", name="j", uid="u", namespace="ns")
    children = sandbox_manifests(owner, job.spec)
    (role,) = [m for m in children if m["kind"] == "Role"]
    return children, _triples(role["rules"])


def test_the_driver_role_is_claim_rules() -> None:
    _, role = _sandbox_job()
    assert role == {(g, r, v) for g, r, verbs in CLAIM_RULES for v in verbs}
    assert ("", "pods/exec", "create") in role
    assert ("extensions.agents.x-k8s.io", "sandboxclaims", "watch") in role  # a claim's Ready, as written
    # what no driver needs: to change or delete a pod, a Sandbox, the template or the pool
    for never in [("", "pods", "delete"), ("agents.x-k8s.io", "sandboxes", "delete"),
                  ("extensions.agents.x-k8s.io", "sandboxwarmpools", "patch"),
                  ("extensions.agents.x-k8s.io", "sandboxclaims", "deletecollection"),
                  ("agents.x-k8s.io", "sandboxes", "get")]:  # fmt: skip
        assert never not in role


def test_the_operator_holds_what_it_grants_and_applies_and_no_more() -> None:
    children, role = _sandbox_job()
    held = _cluster_role()
    applied = {
        (m["apiVersion"].split("/")[0], m["kind"].lower() + "s", v)
        for m in children
        if m["apiVersion"].split("/")[0] in GROUPS
        for v in APPLY_VERBS
    }
    assert {r for _, r, _ in applied} == {"sandboxtemplates", "sandboxwarmpools"}
    missing = (role | applied) - held
    assert not missing, f"manifests/rbac.yaml: the operator lacks {sorted(missing)}"
    extra = {t for t in held if t[0] in GROUPS} - role - applied
    assert not extra, (
        f"manifests/rbac.yaml: the operator holds {sorted(extra)} in agent-sandbox's groups but never uses it"
    )
    core_extra = {t for t in held if t[1] == "pods/exec"} - role
    assert not core_extra, (
        f"manifests/rbac.yaml: pods/exec {sorted(core_extra)} is more than the driver needs"
    )


def test_agent_jobs_may_list_endpointslices_for_session_routing_and_others_not() -> None:
    from lockstep_operator.resources.config import SESSION_ROUTING_RULE, session_routing_rbac

    owner = Owner(api_version="rl.lockstep.dev/v1alpha1", kind="RLJob", name="j", uid="u", namespace="ns")
    role, binding = session_routing_rbac(owner, job="j", agent=True)
    assert _triples(role["rules"]) == {("discovery.k8s.io", "endpointslices", "list")}
    assert (
        binding["subjects"][0]["name"] == "j-driver"
        and binding["roleRef"]["name"] == role["metadata"]["name"]
    )
    assert session_routing_rbac(owner, job="j", agent=False) == []
    assert _triples([SESSION_ROUTING_RULE]) <= _cluster_role()  # the operator holds what it grants
    assert not {t for t in _cluster_role() if t[1] == "endpointslices"} - _triples([SESSION_ROUTING_RULE])
