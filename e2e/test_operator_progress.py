"""The progress channel on a real API server, with the driver's own narrow credentials.

Why: the driver pod may only get/patch ConfigMap `<job>-progress`; that is the whole point of the
channel. Here the operator's own builders render the ConfigMap and the driver's ServiceAccount, Role
and RoleBinding, `kubectl create token` mints a token of that ServiceAccount, and the driver's real
ConfigMapReporter (the code the pod runs) patches the document in over CA-verified TLS. The operator's
reader must get the same report back, and the same token must be Forbidden on any other ConfigMap.
"""

from __future__ import annotations

from pathlib import Path

from lockstep.api.progress import PROGRESS_KEY, ProgressReport
from lockstep.progress import ConfigMapReporter
from lockstep_operator.reconcile.progress import read_progress
from lockstep_operator.resources.common import Owner, driver_name, progress_name
from lockstep_operator.resources.config import driver_rbac, progress_config_map

from e2e.controlplane.cluster import ControlPlane

JOB = "chan"


def _owner(cluster: ControlPlane, ns: str) -> Owner:
    """A live owner object (the RLJob's stand-in), so the garbage collector keeps the children."""
    cluster.kubectl("create", "configmap", f"{JOB}-owner", "-n", ns)
    uid = cluster.get("configmap", f"{JOB}-owner", "-n", ns)["metadata"]["uid"]
    return Owner(api_version="v1", kind="ConfigMap", name=f"{JOB}-owner", uid=uid, namespace=ns)


def test_driver_token_patches_its_progress_configmap_and_nothing_else(
    cluster: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    owner = _owner(cluster, namespace)
    cluster.apply([progress_config_map(owner, job=JOB), *driver_rbac(owner, job=JOB)])
    cluster.kubectl("create", "configmap", "other", "-n", namespace, "--from-literal=keep=me")
    token = cluster.kubectl("create", "token", driver_name(JOB), "-n", namespace, "--duration=10m")
    token_file = tmp_path / "token"
    token_file.write_text(token.stdout.strip())

    def reporter(name: str) -> ConfigMapReporter:
        return ConfigMapReporter(
            cluster.api_url,
            namespace,
            name,
            token_path=token_file,
            ca_path=cluster.ca_file,
            attempts=1,
        )

    sent = ProgressReport(
        step=3,
        weight_version=3,
        reward=0.5,
        staleness=1,
        queue_size=4,
        queue_capacity=8,
        preflight="passed",
        wire_bytes=1024,
    )
    ours = reporter(progress_name(JOB))
    # The RoleBinding reaches the authorizer's cache within moments of its creation.
    cluster.wait_for(lambda: ours.report(sent), timeout=15, what="the driver's patch to be allowed")
    got, problem = read_progress(cluster.get("configmap", progress_name(JOB), "-n", namespace))
    assert problem is None and got == sent

    theirs = reporter("other")
    assert theirs.report(sent) is False
    assert theirs.failures == 1 and "HTTP 403" in theirs.last_error
    data = cluster.get("configmap", "other", "-n", namespace)["data"]
    assert data == {"keep": "me"} and PROGRESS_KEY not in data
