"""The Helm chart (charts/lockstep): `helm lint` passes in every mode, `helm template` renders exactly what
`kubectl apply -k manifests/` installs (and manifests/optional/ what its options add), `helm install`
works on an empty cluster, and its namespaced mode reconciles only the namespaces it lists.

Why: the chart and manifests/ are two doors to one install; a difference between them (a verb, an
env variable, an image) is a bug one set of users hits and the other does not. The namespaced mode is
for shared clusters: the operator must neither need nor use rights outside its namespaces, so the test
runs it with the chart's Roles (its ServiceAccount's own token) and the chart's settings. helm is the
pinned one built by e2e/controlplane/build.sh (e2e/controlplane/helm/go.mod).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lockstep.api.images import image_ref, version

from e2e.controlplane.cluster import ControlPlane, find_binaries
from e2e.operator_runner import CHART, RELEASE, SYSTEM_NS, helm
from e2e.test_operator_manifests import assert_never_forbidden, can, operator_as_service_account
from e2e.test_operator_reconcile import WAIT, running, status, tiny

ROOT = Path(__file__).resolve().parent.parent
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by")
"""Labels Helm's conventions add that manifests/ does not carry."""
OPTIONAL = {
    "servicemonitor.yaml": ["--set=serviceMonitor.enabled=true"],
    "admission-policy.yaml": ["--set=admissionPolicy.enabled=true"],
}
"""manifests/optional/<file> -> the chart values that render it."""


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    return find_binaries()


def run(bin_dir: Path, tool: str, *args: str) -> str:
    proc = subprocess.run(
        [str(bin_dir / tool), *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"{tool} {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def template(bin_dir: Path, *args: str) -> list[dict[str, Any]]:
    out = run(bin_dir, "helm", "template", RELEASE, str(CHART), "-n", SYSTEM_NS, *args)
    return [d for d in yaml.safe_load_all(out) if d]


EXPONENT = re.compile(r"^[-+]?\d+(\.\d*)?[eE][-+]?\d+$")
"""A number kustomize writes as `1e-06`, which YAML 1.1 (PyYAML) reads as a string."""


def without_helm_labels(doc: dict[str, Any]) -> dict[str, Any]:
    """The object with Helm's own labels dropped (everywhere labels appear: metadata, pod template) and
    its numbers as floats (kustomize writes `0.0` as `0`, `1.0e-06` as `1e-06`: the same to the API)."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: ({lk: lv for lk, lv in v.items() if lk not in HELM_LABELS} if k == "labels" else strip(v))
                for k, v in node.items()
            }
        if isinstance(node, list):
            return [strip(v) for v in node]
        if isinstance(node, (int, float)) and not isinstance(node, bool):
            return float(node)
        if isinstance(node, str) and EXPONENT.match(node):
            return float(node)
        return node

    out: dict[str, Any] = strip(doc)
    return out


def by_key(docs: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {
        (d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): without_helm_labels(d)
        for d in docs
    }


@pytest.mark.parametrize(
    "values",
    [
        [],
        ["--set=watchNamespaces={team-a,team-b}"],
        ["--set=serviceMonitor.enabled=true,admissionPolicy.enabled=true"],
    ],
    ids=["cluster-wide", "namespaced", "all-options"],
)
def test_helm_lint_passes(bin_dir: Path, values: list[str]) -> None:
    out = run(bin_dir, "helm", "lint", "--strict", str(CHART), *values)
    assert "0 chart(s) failed" in out, out


def test_helm_template_renders_what_apply_k_installs(bin_dir: Path) -> None:
    chart = by_key(template(bin_dir, "--include-crds"))
    kustomized = [
        d for d in yaml.safe_load_all(run(bin_dir, "kubectl", "kustomize", str(ROOT / "manifests"))) if d
    ]
    manifests = by_key([d for d in kustomized if d["kind"] != "Namespace"])  # helm: the release namespace
    assert sorted(chart) == sorted(manifests)
    for key, doc in manifests.items():
        assert chart[key] == doc, f"{key} differs between charts/lockstep and manifests/"
    # The chart's image references are the package's release ones, as manifests/ names them.
    deploy = chart[("Deployment", SYSTEM_NS, "lockstep-operator")]
    assert deploy["spec"]["template"]["spec"]["containers"][0]["image"] == image_ref("operator")


@pytest.mark.parametrize("name", sorted(OPTIONAL))
def test_the_optional_manifests_are_what_the_chart_options_render(bin_dir: Path, name: str) -> None:
    shipped = [d for d in yaml.safe_load_all((ROOT / "manifests" / "optional" / name).read_text()) if d]
    rendered = template(bin_dir, *OPTIONAL[name], f"--show-only=templates/{name}")
    assert by_key(rendered) == by_key(shipped)


def test_the_chart_version_is_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == version()


@pytest.fixture
def empty_cluster() -> Iterator[ControlPlane]:
    """A control plane of its own (kwok nodes), with nothing installed."""
    with ControlPlane(bin_dir=find_binaries()) as cp:
        yield cp


def create_namespace(cluster: ControlPlane, ns: str) -> None:
    cluster.kubectl("create", "namespace", ns)
    cluster.wait_for(
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0,
        timeout=WAIT,
        what=f"the default ServiceAccount of {ns}",
    )


def deployment_settings(cluster: ControlPlane) -> dict[str, str]:
    """The LOCKSTEP_OPERATOR_* settings the installed Deployment gives the operator."""
    deploy = cluster.get("deployment", "lockstep-operator", "-n", SYSTEM_NS)
    env = deploy["spec"]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e["value"] for e in env if e["name"].startswith("LOCKSTEP_OPERATOR_") and "value" in e}


def test_helm_install_on_an_empty_cluster_then_uninstall(empty_cluster: ControlPlane) -> None:
    cluster = empty_cluster
    helm(
        cluster,
        "install",
        RELEASE,
        str(CHART),
        "-n",
        SYSTEM_NS,
        "--create-namespace",
        "--wait",
        "--timeout=180s",
    )
    for crd in ("rljobs.rl.lockstep.dev", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"):
        cluster.get("crd", crd)
    deploy = cluster.get("deployment", "lockstep-operator", "-n", SYSTEM_NS)
    assert deploy["status"].get("availableReplicas") == 2, deploy["status"]  # kwok runs its pods
    assert cluster.get("clusterrole", "lockstep-operator")["rules"]
    assert (
        cluster.get("service", "lockstep-operator-metrics", "-n", SYSTEM_NS)["spec"]["ports"][0]["port"]
        == 9090
    )
    helm(cluster, "uninstall", RELEASE, "-n", SYSTEM_NS, "--wait", "--timeout=120s")
    assert cluster.kubectl("get", "clusterrole", "lockstep-operator", check=False).returncode != 0
    cluster.get("crd", "rljobs.rl.lockstep.dev")  # Helm keeps CRDs (and so every user's RLJobs)


def test_a_namespaced_install_reconciles_only_its_namespaces(
    empty_cluster: ControlPlane, tmp_path: Path
) -> None:
    """watchNamespaces={team-a}: Roles in team-a and no ClusterRole but reading nodes; the operator, run
    with the Deployment's settings and its ServiceAccount's token, reconciles a job in team-a to its
    pods and never touches the same job in team-b (nor needs a right it lacks)."""
    cluster = empty_cluster
    for ns in ("team-a", "team-b"):
        create_namespace(cluster, ns)
    helm(
        cluster,
        "install",
        RELEASE,
        str(CHART),
        "-n",
        SYSTEM_NS,
        "--create-namespace",
        "--set=watchNamespaces={team-a}",
    )
    roles = cluster.get("clusterroles", "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
    assert [r["metadata"]["name"] for r in roles] == [f"lockstep-operator-{SYSTEM_NS}-nodes"]
    assert roles[0]["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]}]
    cluster.get("role", "lockstep-operator", "-n", "team-a")
    assert can(cluster, "create", "", "pods", namespace="team-a")
    for ns in ("team-b", "kube-system", SYSTEM_NS):
        assert not can(cluster, "create", "", "pods", namespace=ns), ns
        assert not can(cluster, "list", "rl.lockstep.dev", "rljobs", namespace=ns), ns
    settings = deployment_settings(cluster)
    assert settings["LOCKSTEP_OPERATOR_NAMESPACES"] == "team-a"
    with operator_as_service_account(cluster, tmp_path, settings) as log:
        for ns in ("team-a", "team-b"):
            cluster.apply(tiny("shared"), namespace=ns)
        running(cluster, "team-a", "shared", "driver", 1)
        cluster.wait_for(
            lambda: status(cluster, "team-a", "rljob", "shared").get("phase") == "Preflight",
            timeout=WAIT,
            what="the job in team-a in Preflight",
        )
        cluster.get("kopfpeering", "lockstep-operator", "-n", "team-a")  # created at start, in its namespace
        # By now the operator has reconciled team-a's job through several passes: team-b's is untouched.
        assert status(cluster, "team-b", "rljob", "shared") == {}
        children = "pods,configmaps,services,rolloutpools,trainergroups,weightchannels"
        assert cluster.get(children, "-n", "team-b", "-l", "rl.lockstep.dev/job=shared")["items"] == []
        assert cluster.get(children, "-n", "team-a", "-l", "rl.lockstep.dev/job=shared")["items"]
    assert_never_forbidden(log)
