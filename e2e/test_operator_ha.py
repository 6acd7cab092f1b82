"""End-to-end: two operator replicas with kopf peering; one reconciles, the other takes over when it dies.

Why: manifests/deployment.yaml runs 2 replicas with peering (HA); that only holds if exactly one of
them acts at a time and the standby resumes when the active one is gone. Two real operator processes
(`python -m lockstep_operator`, as the Deployment runs it) share one ClusterKopfPeering against the
real control plane. Each serves its Prometheus metrics; `lockstep_operator_reconciles_total` tells
which one did the work. The active one is SIGKILLed (no graceful goodbye in the peering object), so
the standby must notice its record expiring: the peering lifetime is shortened through
LOCKSTEP_OPERATOR_PEERING_LIFETIME_SECONDS rather than waiting the default minute.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.controlplane.cluster import ControlPlane
from e2e.controlplane.ports import free_ports
from e2e.test_operator_reconcile import JOB, WAIT, pods, running, tiny

ROOT = Path(__file__).resolve().parent.parent
PEERING = "lockstep-e2e-ha"
LIFETIME_S = 4


class Replica:
    """One operator process of the peering, with its metrics port."""

    def __init__(self, name: str, priority: int, cluster: ControlPlane, log_dir: Path) -> None:
        self.name = name
        self.metrics_port = free_ports(1)[0]
        env = {
            **os.environ,
            "KUBECONFIG": str(cluster.kubeconfig),
            "POD_ID": name,  # kopf's identity of this replica in the peering object
            "LOCKSTEP_OPERATOR_HA_MODE": "peering",
            "LOCKSTEP_OPERATOR_PEERING_NAME": PEERING,
            "LOCKSTEP_OPERATOR_PRIORITY": str(priority),
            "LOCKSTEP_OPERATOR_PEERING_LIFETIME_SECONDS": str(LIFETIME_S),
            "LOCKSTEP_OPERATOR_RESYNC_SECONDS": "3",
            "LOCKSTEP_OPERATOR_HEALTH_PORT": "0",
            "LOCKSTEP_OPERATOR_METRICS_PORT": str(self.metrics_port),
            "LOCKSTEP_OPERATOR_LOG_FORMAT": "text",
        }
        self.log = (log_dir / f"{name}.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lockstep_operator"], env=env, stdout=self.log, stderr=subprocess.STDOUT
        )

    def reconciles(self) -> float | None:
        """Sum of lockstep_operator_reconciles_total (None while the metrics endpoint is not up)."""
        try:
            url = f"http://127.0.0.1:{self.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=2) as rsp:
                text = rsp.read().decode()
        except OSError:
            return None
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("lockstep_operator_reconciles_total{")
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def replicas(cluster: ControlPlane, tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    """CRDs and the peering installed; two replicas started (priority 200 and 100), stopped after."""
    crds = sorted((ROOT / "crds").glob("rl.lockstep.dev_*.yaml"))
    for crd in crds:
        cluster.apply(crd.read_text())
    peering_docs = list(yaml.safe_load_all((ROOT / "manifests" / "kopf-peering.yaml").read_text()))
    cluster.apply([d for d in peering_docs if d["kind"] == "CustomResourceDefinition"])
    for crd in [*crds, ROOT / "manifests" / "kopf-peering.yaml"]:
        name = next(d for d in yaml.safe_load_all(crd.read_text()) if d["kind"] == "CustomResourceDefinition")
        cluster.kubectl(
            "wait", "--for=condition=Established", f"crd/{name['metadata']['name']}", "--timeout=60s"
        )
    # No ClusterKopfPeering object: the first replica creates it at start (handlers.ensure_peering).
    # The standby starts once the active replica is in the peering object, as in a rolling update:
    # kopf starts paused until it has read the peering, so it never acts. (Two replicas started at the
    # same instant may both act for the moment before they see each other; the reconciles are
    # idempotent, see test_operator_restarted_mid_reconcile_leaves_no_duplicates.)
    pair: list[Replica] = []
    try:
        pair.append(Replica("replica-a", 200, cluster, tmp_path))
        cluster.wait_for(lambda: "replica-a" in peers(cluster), timeout=WAIT, what="replica-a in the peering")
        pair.append(Replica("replica-b", 100, cluster, tmp_path))
        yield pair[0], pair[1]
    finally:
        for replica in pair:
            replica.stop()
        cluster.kubectl("delete", "clusterkopfpeering", PEERING, "--wait=false", check=False)


def peers(cluster: ControlPlane) -> dict[str, Any]:
    status: dict[str, Any] = cluster.get("clusterkopfpeering", PEERING).get("status") or {}
    return status


def test_one_replica_reconciles_and_the_standby_takes_over(
    cluster: ControlPlane, replicas: tuple[Replica, Replica], namespace: str
) -> None:
    a, b = replicas
    cluster.wait_for(
        lambda: {"replica-a", "replica-b"} <= set(peers(cluster)) and a.reconciles() is not None
        and b.reconciles() is not None,
        timeout=WAIT,
        what="both replicas in the peering object with their metrics up",
    )  # fmt: skip
    first = "ha-first"
    cluster.apply(tiny(first, rollout={"replicas": 2}), namespace=namespace)
    running(cluster, namespace, first, "engine", 2)
    running(cluster, namespace, first, "trainer", 1)
    running(cluster, namespace, first, "driver", 1)
    names = [p["metadata"]["name"] for p in pods(cluster, namespace, first)]
    assert len(names) == len(set(names)) == 4
    # Exactly one replica did the work: the one of higher priority; the other stayed paused.
    assert (a.reconciles() or 0) > 0 and b.reconciles() == 0, (a.reconciles(), b.reconciles())
    for kind in ("rolloutpool", "trainergroup", "weightchannel", "services", "configmaps"):
        found = [
            o["metadata"]["name"] for o in cluster.get(kind, "-n", namespace, "-l", f"{JOB}={first}")["items"]
        ]
        assert len(found) == len(set(found)), f"duplicate {kind}: {found}"

    a.proc.kill()  # SIGKILL: its peering record stays until it expires
    a.proc.wait()
    second = "ha-second"
    cluster.apply(tiny(second, rollout={"replicas": 2}), namespace=namespace)
    running(cluster, namespace, second, "engine", 2)
    running(cluster, namespace, second, "trainer", 1)
    running(cluster, namespace, second, "driver", 1)
    assert (b.reconciles() or 0) > 0  # the standby took over
    assert "replica-a" not in peers(cluster)  # and cleaned the dead replica's record
