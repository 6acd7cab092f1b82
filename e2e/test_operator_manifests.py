"""The install manifests (manifests/) are valid for the real API server and grant what the operator uses.

Why: a kustomization that does not build, a Deployment the apiserver refuses or an RBAC rule missing
a verb only shows up at install time in a real cluster; this catches them here. The RBAC objects are
applied for real and checked with `kubectl auth can-i` as the operator's service account.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from e2e.controlplane.cluster import ControlPlane

ROOT = Path(__file__).resolve().parent.parent
SA = "system:serviceaccount:lockstep-system:lockstep-operator"


def build(tmp_path: Path) -> Path:
    """A copy of manifests/ and crds/ (crds/ carries its generated kustomization)."""
    shutil.copytree(ROOT / "manifests", tmp_path / "manifests")
    shutil.copytree(ROOT / "crds", tmp_path / "crds")
    return tmp_path / "manifests"


def test_manifests_build_and_pass_server_validation(cluster: ControlPlane, tmp_path: Path) -> None:
    out = cluster.kubectl("kustomize", str(build(tmp_path))).stdout
    kinds = sorted({d["kind"] for d in yaml.safe_load_all(out) if d})
    assert kinds == ["ClusterKopfPeering", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                     "Deployment", "Namespace", "ServiceAccount"]  # fmt: skip
    docs = [d for d in yaml.safe_load_all(out) if d and d["kind"] != "ClusterKopfPeering"]
    cluster.apply([d for d in docs if d["kind"] == "Namespace"])  # namespaced objects need it to exist
    cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(docs))
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert deploy["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_operator_service_account_may_do_what_it_does_and_no_more(
    cluster: ControlPlane, tmp_path: Path
) -> None:
    out = cluster.kubectl("kustomize", str(build(tmp_path))).stdout
    rbac = [
        d
        for d in yaml.safe_load_all(out)
        if d and d["kind"] in ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding")
    ]
    cluster.apply(rbac)

    def can(verb: str, group: str, resource: str, subresource: str = "") -> bool:
        """A SubjectAccessReview as the operator's service account (no client-side discovery)."""
        attrs = {"verb": verb, "group": group, "resource": resource, "subresource": subresource}
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                  "spec": {"user": SA, "groups": ["system:serviceaccounts", "system:authenticated"],
                           "resourceAttributes": attrs}}  # fmt: skip
        out = cluster.kubectl("create", "-o", "json", "-f", "-", input=yaml.safe_dump(review)).stdout
        return bool(json.loads(out)["status"].get("allowed"))

    rl = "rl.lockstep.dev"
    needed = [("watch", rl, "rljobs"), ("patch", rl, "rljobs", "status"), ("patch", rl, "rolloutpools", "status"),
              ("create", "", "pods"), ("delete", "", "pods"), ("patch", "", "configmaps"),
              ("create", "rbac.authorization.k8s.io", "roles"), ("list", "", "nodes"),
              ("create", "scheduling.volcano.sh", "podgroups"), ("create", "", "events"),
              ("patch", "networking.k8s.io", "networkpolicies"), ("patch", "", "pods", "status")]  # fmt: skip
    for check in needed:
        assert can(*check), f"the operator cannot {check}"
    never = [("get", "", "secrets"), ("delete", "", "nodes"), ("create", "rbac.authorization.k8s.io", "clusterroles"),
             ("escalate", "rbac.authorization.k8s.io", "roles"), ("delete", rl, "rljobs")]  # fmt: skip
    for check in never:
        assert not can(*check), f"the operator may {check} but never needs to"
