"""The install manifests (manifests/) install on an empty cluster at the first `kubectl apply -k`, and
the operator runs with exactly the rights they grant.

Why: a kustomization that does not build, a CRD and an object of it in one apply ("no matches for
kind"), or an RBAC rule missing a verb only shows up at install time in a real cluster; this catches
them here. The RBAC is checked two ways: SubjectAccessReviews for what must and must never be
allowed, and the operator process itself run with the ServiceAccount's own token (kubectl create
token), reconciling a job to all its pods with no ReconcileError: a verb it uses but the ClusterRole
lacks fails that run with a Forbidden condition naming it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.controlplane.cluster import ControlPlane, find_binaries
from e2e.test_operator_reconcile import WAIT, cond, running, status, tiny

ROOT = Path(__file__).resolve().parent.parent
SA = "system:serviceaccount:lockstep-system:lockstep-operator"


def build(tmp_path: Path) -> Path:
    """A copy of manifests/ and crds/ (crds/ carries its generated kustomization)."""
    shutil.copytree(ROOT / "manifests", tmp_path / "manifests")
    shutil.copytree(ROOT / "crds", tmp_path / "crds")
    return tmp_path / "manifests"


def kinds_of(text: str) -> list[str]:
    return sorted({d["kind"] for d in yaml.safe_load_all(text) if d})


def test_manifests_build_and_pass_server_validation(cluster: ControlPlane, tmp_path: Path) -> None:
    out = cluster.kubectl("kustomize", str(build(tmp_path))).stdout
    assert kinds_of(out) == ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment",
                             "Namespace", "Service", "ServiceAccount"]  # fmt: skip
    docs = [d for d in yaml.safe_load_all(out) if d]
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # Service links off: the metrics Service would set LOCKSTEP_OPERATOR_METRICS_PORT=tcp://... in the pod,
    # which the operator reads as its own setting and refuses (it crash-looped so in the cluster).
    assert pod["enableServiceLinks"] is False
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    requests = container["resources"]["requests"]
    assert requests["memory"] and requests["cpu"]


@pytest.fixture
def empty_cluster() -> Iterator[ControlPlane]:
    """A control plane of its own (kwok nodes), with nothing installed."""
    with ControlPlane(
        bin_dir=find_binaries(), keep_work_dir=os.environ.get("LOCKSTEP_E2E_KEEP") == "1"
    ) as cp:
        yield cp


def sa_kubeconfig(cluster: ControlPlane, path: Path) -> Path:
    """A kubeconfig with the operator ServiceAccount's own token (as its pod would have)."""
    token = cluster.kubectl(
        "create", "token", "lockstep-operator", "-n", "lockstep-system", "--duration=1h"
    ).stdout
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "c", "cluster": {"server": cluster.api_url, "certificate-authority": str(cluster.ca_file)}}],
        "users": [{"name": "sa", "user": {"token": token.strip()}}],
        "contexts": [{"name": "sa", "context": {"cluster": "c", "user": "sa"}}],
    }  # fmt: skip
    path.write_text(yaml.safe_dump(config))
    return path


def test_apply_k_installs_on_an_empty_cluster_and_the_operator_runs_with_those_rights(
    empty_cluster: ControlPlane, tmp_path: Path
) -> None:
    cluster = empty_cluster
    applied = cluster.kubectl("apply", "-k", str(build(tmp_path)), timeout=120)  # the first time, as a user
    assert "customresourcedefinition.apiextensions.k8s.io/rljobs.rl.lockstep.dev" in applied.stdout
    cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
    ns = "users"
    cluster.kubectl("create", "namespace", ns)
    cluster.wait_for(
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0,
        timeout=WAIT,
        what="the namespace's default ServiceAccount",
    )
    with operator_as_service_account(cluster, tmp_path) as log:
        cluster.apply(tiny("as-installed", rollout={"replicas": 2}), namespace=ns)
        running(cluster, ns, "as-installed", "engine", 2)
        running(cluster, ns, "as-installed", "trainer", 1)
        running(cluster, ns, "as-installed", "driver", 1)
        cluster.wait_for(
            lambda: status(cluster, ns, "rljob", "as-installed").get("phase") == "Preflight",
            timeout=WAIT,
            what="the job in Preflight",
        )
        st = status(cluster, ns, "rljob", "as-installed")
        assert not cond(st, "ReconcileError"), st
        peering: dict[str, Any] = cluster.get("clusterkopfpeering", "lockstep-operator")
        assert "lockstep-operator-test" in (peering.get("status") or {})  # created and joined at start
        for kind in ("configmaps", "networkpolicies", "roles", "rolebindings", "services"):
            assert cluster.get(kind, "-n", ns, "-l", "rl.lockstep.dev/job=as-installed")["items"], kind
    assert_never_forbidden(log)


@contextmanager
def operator_as_service_account(
    cluster: ControlPlane, tmp_path: Path, settings: dict[str, str] | None = None
) -> Iterator[Path]:
    """The operator process (`python -m lockstep_operator`, as the image runs it) with the operator
    ServiceAccount's own token and HA peering as the Deployment runs it; `settings` are further
    LOCKSTEP_OPERATOR_* variables. Yields its log file; stopped on exit."""
    env = {
        **os.environ,
        "LOCKSTEP_OPERATOR_HA_MODE": "peering",
        **(settings or {}),
        "KUBECONFIG": str(sa_kubeconfig(cluster, tmp_path / "sa.kubeconfig")),
        "LOCKSTEP_OPERATOR_HEALTH_PORT": "0",
        "LOCKSTEP_OPERATOR_METRICS_PORT": "0",
        "LOCKSTEP_OPERATOR_LOG_FORMAT": "text",
        "POD_NAME": "lockstep-operator-test",
        "POD_ID": "lockstep-operator-test",
    }
    path = tmp_path / "operator.log"
    with path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lockstep_operator"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            yield path
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def assert_never_forbidden(log: Path) -> None:
    """No request of the operator was refused by RBAC (a verb it uses that its role lacks)."""
    text = log.read_text()
    assert not re.search(r"status=403|403 Forbidden|Forbidden|is forbidden", text), text[-3000:]


def can(
    cluster: ControlPlane, verb: str, group: str, resource: str, subresource: str = "", namespace: str = ""
) -> bool:
    """A SubjectAccessReview as the operator's service account (no client-side discovery); in every
    namespace unless `namespace` names one."""
    attrs = {
        "verb": verb,
        "group": group,
        "resource": resource,
        "subresource": subresource,
        "namespace": namespace,
    }
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
              "spec": {"user": SA, "groups": ["system:serviceaccounts", "system:authenticated"],
                       "resourceAttributes": attrs}}  # fmt: skip
    out = cluster.kubectl("create", "-o", "json", "-f", "-", input=yaml.safe_dump(review)).stdout
    return bool(json.loads(out)["status"].get("allowed"))


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
    rl = "rl.lockstep.dev"
    needed = [("watch", rl, "rljobs"), ("patch", rl, "rljobs", "status"), ("patch", rl, "rolloutpools", "status"),
              ("create", "", "pods"), ("delete", "", "pods"), ("patch", "", "configmaps"),
              ("create", "rbac.authorization.k8s.io", "roles"), ("list", "", "nodes"),
              ("create", "scheduling.volcano.sh", "podgroups"), ("create", "", "events"), ("patch", "", "events"),
              ("patch", "networking.k8s.io", "networkpolicies"), ("patch", "", "pods", "status"),
              ("create", "kopf.dev", "clusterkopfpeerings"),
              ("patch", "extensions.agents.x-k8s.io", "sandboxwarmpools"),
              ("create", "extensions.agents.x-k8s.io", "sandboxclaims"), ("create", "", "pods", "exec"),
              ("get", "", "pods", "exec")]  # fmt: skip
    for check in needed:
        assert can(cluster, *check), f"the operator cannot {check}"
    never = [("get", "", "secrets"), ("delete", "", "nodes"), ("create", "rbac.authorization.k8s.io", "clusterroles"),
             ("escalate", "rbac.authorization.k8s.io", "roles"), ("bind", "rbac.authorization.k8s.io", "roles"),
             ("delete", rl, "rljobs"), ("get", "", "services"), ("list", "apiextensions.k8s.io", "customresourcedefinitions"),
             ("list", "", "namespaces"), ("watch", "", "nodes"), ("get", "rbac.authorization.k8s.io", "roles"),
             ("get", rl, "rljobs", "status"),
             ("delete", "extensions.agents.x-k8s.io", "sandboxtemplates"), ("watch", "agents.x-k8s.io", "sandboxes"),
             ("create", "", "pods", "attach"), ("create", "", "pods", "portforward")]  # fmt: skip
    for check in never:
        assert not can(cluster, *check), f"the operator may {check} but never needs to"
