"""The pod behaviours our kwok stages promise (docs/controlplane.md, "Pod behaviour").

Why: the operator tests inject engine and trainer-rank failures and rely on Job pods completing or
staying up; each rule of e2e/controlplane/stages/ is checked here against the real controllers.
"""

from __future__ import annotations

from typing import Any

from e2e.controlplane.cluster import ControlPlane

IMAGE = "registry.invalid/lockstep/sim:0"


def job(
    name: str, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {"job": name, **(labels or {})}, "annotations": annotations or {}},
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": {"type": "kwok"},
                    "containers": [{"name": "trainer", "image": IMAGE}, {"name": "sidecar", "image": IMAGE}],
                },
            },
        },
    }


def job_pod(cluster: ControlPlane, namespace: str, name: str) -> dict[str, Any] | None:
    items = cluster.get("pods", "-n", namespace, "-l", f"job={name}")["items"]
    return items[0] if items else None


def phase(p: dict[str, Any] | None) -> str | None:
    return None if p is None else p["status"].get("phase")


def test_keep_running_job_pod_stays_up_and_deletion_terminates_it(
    cluster: ControlPlane, namespace: str
) -> None:
    cluster.apply(job("rank", labels={"lockstep.dev/keep-running": "true"}), namespace=namespace)
    p = cluster.wait_for(
        lambda: (
            phase(job_pod(cluster, namespace, "rank")) == "Running" and job_pod(cluster, namespace, "rank")
        ),
        timeout=60,
        what="the keep-running Job pod Running",
    )
    assert p
    # A Job with a completing pod would be Complete by now (500 ms); this one has no succeeded pod.
    other = job("quick")
    cluster.apply(other, namespace=namespace)
    cluster.wait_for(
        lambda: cluster.get("job", "quick", "-n", namespace)["status"].get("succeeded") == 1,
        timeout=60,
        what="Job quick to succeed",
    )
    assert phase(job_pod(cluster, namespace, "rank")) == "Running"
    assert "batch.kubernetes.io/job-tracking" in (p["metadata"].get("finalizers") or [])

    # Deleting the running pod (which carries the Job's tracking finalizer) must not hang in Terminating.
    cluster.kubectl("delete", "pod", p["metadata"]["name"], "-n", namespace, "--wait=false")
    cluster.wait_for(
        lambda: (
            cluster.kubectl("get", "pod", p["metadata"]["name"], "-n", namespace, check=False).returncode != 0
        ),
        timeout=60,
        what="the deleted Job pod to be removed",
    )
    status = cluster.wait_for(
        lambda: cluster.get("job", "rank", "-n", namespace)["status"].get("failed"),
        timeout=60,
        what="Job rank to count the deleted pod as failed",
    )
    assert status == 1


def test_failure_patched_onto_a_running_pod_names_one_container(
    cluster: ControlPlane, namespace: str
) -> None:
    cluster.apply(job("engine", labels={"lockstep.dev/keep-running": "true"}), namespace=namespace)
    p = cluster.wait_for(
        lambda: phase(q := job_pod(cluster, namespace, "engine")) == "Running" and q,
        timeout=60,
        what="engine pod Running",
    )
    assert p
    name = p["metadata"]["name"]
    cluster.kubectl(
        "annotate",
        "pod",
        name,
        "-n",
        namespace,
        "lockstep.dev/failure-exit-code=3",
        "lockstep.dev/failure-container=trainer",
        "lockstep.dev/failure-message=NCCL timeout",
    )
    cluster.kubectl("label", "pod", name, "-n", namespace, "lockstep.dev/inject-failure=container")
    failed = cluster.wait_for(
        lambda: phase(q := job_pod(cluster, namespace, "engine")) == "Failed" and q,
        timeout=60,
        what="engine pod Failed after the label",
    )
    assert failed
    states = {c["name"]: c["state"]["terminated"] for c in failed["status"]["containerStatuses"]}
    assert (states["trainer"]["exitCode"], states["trainer"]["message"]) == (3, "NCCL timeout")
    assert states["sidecar"]["exitCode"] == 137
    cluster.wait_for(
        lambda: cluster.get("job", "engine", "-n", namespace)["status"].get("failed") == 1,
        timeout=60,
        what="Job engine to count the failed pod",
    )


def test_complete_after_delays_completion(cluster: ControlPlane, namespace: str) -> None:
    cluster.apply(job("slow", annotations={"lockstep.dev/complete-after": "1h"}), namespace=namespace)
    cluster.wait_for(
        lambda: phase(job_pod(cluster, namespace, "slow")) == "Running", timeout=60, what="slow pod Running"
    )
    cluster.apply(job("fast"), namespace=namespace)
    cluster.wait_for(
        lambda: cluster.get("job", "fast", "-n", namespace)["status"].get("succeeded") == 1,
        timeout=60,
        what="Job fast to succeed",
    )
    assert phase(job_pod(cluster, namespace, "slow")) == "Running"
