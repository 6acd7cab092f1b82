"""End-to-end: every pod kind of a job passes Pod Security Standards "restricted", enforced by the real
API server's PodSecurity admission in a namespace labelled for it; the RDMA rank is the documented
exception and is refused there with a ReconcileError naming why.

Why: a cluster that enforces "restricted" (a common default for tenant namespaces) refuses any pod
without a seccomp profile; before the pods carried one, an RLJob there stayed without a phase while
the operator retried every second. The pods here include the init steps (pull-model for a hub
checkpoint, convert-model for FP8 serving), so every container the operator renders is checked.
"""

from __future__ import annotations

from typing import Any

from e2e import test_operator_reconcile
from e2e.controlplane.cluster import ControlPlane
from e2e.operator_runner import Operator
from e2e.test_operator_reconcile import WAIT, cond, pods, running, status, tiny

operator = test_operator_reconcile.operator
"""The operator running for this module (the same fixture as e2e/test_operator_reconcile.py's)."""

ENFORCE = "pod-security.kubernetes.io/enforce"


def restricted(cluster: ControlPlane, namespace: str) -> None:
    cluster.kubectl("label", "namespace", namespace, f"{ENFORCE}=restricted", f"{ENFORCE}-version=latest")


def test_every_pod_kind_is_admitted_under_restricted(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    restricted(cluster, namespace)
    job = "restricted"
    manifest = tiny(
        job, model={"checkpoint": "lockstep-test/tiny@main"}, rollout={"replicas": 2, "precision": "fp8"}
    )
    cluster.apply(manifest, namespace=namespace)
    engines = running(cluster, namespace, job, "engine", 2)
    running(cluster, namespace, job, "trainer", 1)
    (driver,) = running(cluster, namespace, job, "driver", 1)
    inits = {c["name"] for p in (*engines, driver) for c in p["spec"].get("initContainers", [])}
    assert {"pull-model", "convert-model"} <= inits  # the init steps were admitted too
    for pod in pods(cluster, namespace, job):
        spec = pod["spec"]
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        engine = pod["metadata"]["labels"]["rl.lockstep.dev/role"] == "engine"
        assert spec.get("automountServiceAccountToken") is (False if engine else None), pod["metadata"][
            "name"
        ]
        if engine:  # no token in the engine's filesystem
            mounts = [m["mountPath"] for m in spec["containers"][0]["volumeMounts"]]
            assert not any(m.startswith("/var/run/secrets/kubernetes.io") for m in mounts)
    assert not cond(status(cluster, namespace, "rljob", job), "ReconcileError")


def test_an_rdma_rank_is_the_exception_and_is_refused_with_the_reason(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    restricted(cluster, namespace)
    job = "rdma"
    cluster.apply(tiny(job, weightSync={"transport": "p2p"}), namespace=namespace)

    def refused() -> dict[str, Any] | None:
        found = cond(status(cluster, namespace, "rljob", job), "ReconcileError")
        return found if found.get("status") == "True" else None

    error = cluster.wait_for(refused, timeout=WAIT, what="the rank pod refused")
    assert error is not None
    assert error["reason"] == "AdmissionDenied" and "IPC_LOCK" in error["message"], error
    assert 'violates PodSecurity "restricted:latest"' in error["message"]
    assert not pods(cluster, namespace, job, "trainer")
