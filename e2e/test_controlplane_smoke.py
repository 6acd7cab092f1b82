"""Smoke test of the local control plane: nodes, scheduling onto GPU nodes, GC, Jobs, failure injection.

Why: every other e2e test relies on these behaviours of e2e/controlplane (real apiserver, controllers,
scheduler; kwok playing the kubelets); if one breaks, this file says which. Also proves that a
ControlPlane stops without leaving a process or a listening port.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from e2e.controlplane import ports as portutil
from e2e.controlplane.cluster import COMPONENTS, DEFAULT_NODES, HERE, ControlPlane, _group_alive
from e2e.controlplane.nodes import NodePool, load_pools, node_objects

IMAGE = "registry.invalid/lockstep/sim:0"  # never pulled: kwok plays the kubelet


def pod_spec(gpus: int, selector: dict[str, str], **extra: Any) -> dict[str, Any]:
    return {
        "nodeSelector": selector,
        "containers": [
            {"name": "main", "image": IMAGE, "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}
        ],
        **extra,
    }


def pod(cluster: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    result: dict[str, Any] = cluster.get("pod", name, "-n", namespace)
    return result


def test_kubectl_lists_gpu_nodes_with_capacity(cluster: ControlPlane) -> None:
    nodes = cluster.get("nodes", "-l", "nvidia.com/gpu.present=true")["items"]
    gpus = {n["metadata"]["name"]: n["status"]["allocatable"]["nvidia.com/gpu"] for n in nodes}
    expected = {
        o["metadata"]["name"]: o["status"]["capacity"]["nvidia.com/gpu"]
        for o in node_objects([p for p in load_pools(DEFAULT_NODES) if "nvidia.com/gpu" in p.capacity])
    }
    # Other tests may add GPU nodes to the shared cluster: the default ones must all be there as declared.
    assert {name: gpus.get(name) for name in expected} == expected
    assert {v for k, v in gpus.items() if k.startswith("h100")} == {"8"}
    assert {v for k, v in gpus.items() if k.startswith("gb300")} == {"4"}
    by_name = {n["metadata"]["name"]: n for n in nodes}
    assert "rdma/ib" in by_name["h100-ib-0"]["status"]["allocatable"]
    assert "rdma/ib" not in by_name["h100-eth-0"]["status"]["allocatable"]
    assert by_name["gb300-0"]["status"]["nodeInfo"]["architecture"] == "arm64"
    cliques = {
        n["metadata"]["labels"]["nvidia.com/gpu.clique"] for k, n in by_name.items() if k.startswith("gb300")
    }
    assert len(cliques) == 2
    # The human-facing view works too: custom columns from the built kubectl.
    out = cluster.kubectl(
        "get", "nodes", "-o", r"custom-columns=NAME:.metadata.name,GPU:.status.capacity.nvidia\.com/gpu"
    ).stdout
    table = dict(line.split() for line in out.splitlines()[1:])
    assert (table["h100-ib-0"], table["gb300-17"], table["cpu-0"]) == ("8", "4", "<none>")


def test_h100_pod_runs_and_is_garbage_collected_with_its_replicaset(
    cluster: ControlPlane, namespace: str
) -> None:
    labels = {"app": "h100-smoke"}
    cluster.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {"name": "h100", "namespace": namespace},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": pod_spec(8, {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}),
                },
            },
        }
    )

    def running_pod() -> dict[str, Any] | None:
        items = cluster.get("pods", "-n", namespace, "-l", "app=h100-smoke")["items"]
        return next((p for p in items if p["status"].get("phase") == "Running"), None)

    p = cluster.wait_for(running_pod, timeout=60, what="the ReplicaSet's H100 pod Running")
    assert p is not None
    assert p["spec"]["nodeName"].startswith("h100-")
    assert all(c["ready"] for c in p["status"]["containerStatuses"])

    cluster.kubectl("delete", "replicaset", "h100", "-n", namespace, "--cascade=background")
    cluster.wait_for(
        lambda: not cluster.get("pods", "-n", namespace, "-l", "app=h100-smoke")["items"],
        timeout=60,
        what="the garbage collector to delete the pod of the deleted ReplicaSet",
    )


def test_gb300_pod_lands_on_gb300_node(cluster: ControlPlane, namespace: str) -> None:
    spec = pod_spec(4, {"nvidia.com/gpu.product": "NVIDIA-GB300", "kubernetes.io/arch": "arm64"})
    cluster.apply(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gb", "namespace": namespace}, "spec": spec}
    )
    p = cluster.wait_for(
        lambda: (q := pod(cluster, namespace, "gb"))["status"].get("phase") == "Running" and q,
        timeout=60,
        what="the GB300 pod Running",
    )
    assert p["spec"]["nodeName"].startswith("gb300-")


def test_too_many_gpus_stays_pending(cluster: ControlPlane, namespace: str) -> None:
    # 9 GPUs fit no H100 node: the scheduler must refuse (proves extended resources are enforced).
    spec = pod_spec(9, {"nvidia.com/gpu.family": "hopper"})
    cluster.apply(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "big", "namespace": namespace}, "spec": spec}
    )

    def unschedulable() -> bool:
        conds = pod(cluster, namespace, "big")["status"].get("conditions") or []
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conds)

    cluster.wait_for(unschedulable, timeout=60, what="PodScheduled=False/Unschedulable for a 9-GPU pod")


def test_job_pod_completes(cluster: ControlPlane, namespace: str) -> None:
    cluster.apply(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "once", "namespace": namespace},
            "spec": {
                "backoffLimit": 0,
                "template": {
                    "spec": {**pod_spec(1, {"nvidia.com/gpu.family": "hopper"}), "restartPolicy": "Never"}
                },
            },
        }
    )
    job = cluster.wait_for(
        lambda: (j := cluster.get("job", "once", "-n", namespace))["status"].get("succeeded") == 1 and j,
        timeout=60,
        what="Job once to succeed",
    )
    assert any(c["type"] == "Complete" and c["status"] == "True" for c in job["status"]["conditions"])


def test_injected_failure_fails_the_pod(cluster: ControlPlane, namespace: str) -> None:
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "doomed",
                "namespace": namespace,
                "labels": {"lockstep.dev/inject-failure": "container"},
                "annotations": {
                    "lockstep.dev/failure-exit-code": "137",
                    "lockstep.dev/failure-reason": "OOMKilled",
                },
            },
            "spec": {**pod_spec(8, {"nvidia.com/gpu.family": "hopper"}), "restartPolicy": "Never"},
        }
    )
    p = cluster.wait_for(
        lambda: (q := pod(cluster, namespace, "doomed"))["status"].get("phase") == "Failed" and q,
        timeout=60,
        what="the pod with an injected failure to turn Failed",
    )
    term = p["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (term["exitCode"], term["reason"]) == (137, "OOMKilled")


def test_added_nodes_become_ready_and_schedulable(cluster: ControlPlane, namespace: str) -> None:
    # Tainted so that no other test's pod lands on it while it exists; removed at the end.
    taint = {"key": "lockstep.dev/e2e-smoke", "value": "extra", "effect": "NoSchedule"}
    pool = NodePool(
        prefix="smoke-extra",
        count=1,
        capacity={"cpu": "8", "memory": "32Gi", "pods": "10", "example.com/widget": "3"},
        taints=[taint],
    )
    try:
        assert cluster.add_nodes([pool]) == ["smoke-extra-0"]
        spec = {
            "tolerations": [{**taint, "operator": "Equal"}],
            "containers": [
                {"name": "main", "image": IMAGE, "resources": {"limits": {"example.com/widget": "3"}}}
            ],
        }
        cluster.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "w", "namespace": namespace},
                "spec": spec,
            }
        )
        node = cluster.wait_for(
            lambda: pod(cluster, namespace, "w")["spec"].get("nodeName"), timeout=60, what="pod w bound"
        )
        assert node == "smoke-extra-0"
    finally:
        cluster.kubectl("delete", "node", "smoke-extra-0", "--wait=false", check=False)


@pytest.mark.timeout(180)
def test_start_sh_and_stop_sh_leave_no_process_and_no_port(cluster: ControlPlane, tmp_path: Path) -> None:
    # A second, short-lived control plane (no nodes) through the people's scripts: it must outlive the
    # start script, answer with the printed KUBECONFIG, and stop must leave nothing behind.
    state, bin_dir = tmp_path / "running.json", cluster.bin_dir
    assert bin_dir is not None
    env = {**os.environ, "LOCKSTEP_CONTROLPLANE_BIN": str(bin_dir), "PYTHON": sys.executable}
    start = subprocess.run(
        ["bash", str(HERE / "start.sh"), "--no-nodes", "--state", str(state)],
        capture_output=True,
        text=True,
        env=env,
        timeout=150,
        check=False,
    )
    assert start.returncode == 0, start.stderr
    saved = json.loads(state.read_text())
    try:
        kubeconfig = next(
            line.split("=", 1)[1] for line in start.stdout.splitlines() if "KUBECONFIG=" in line
        )
        readyz = subprocess.run(
            [str(bin_dir / "kubectl"), f"--kubeconfig={kubeconfig}", "get", "--raw", "/readyz"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert readyz.stdout == "ok", readyz.stderr
        assert sorted(saved["pids"]) == sorted(COMPONENTS)
        assert portutil.listening(saved["ports"]) == sorted(saved["ports"])
    finally:
        stop = subprocess.run(
            ["bash", str(HERE / "stop.sh"), "--state", str(state)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
    assert stop.returncode == 0, stop.stderr
    assert [n for n, p in saved["pids"].items() if _group_alive(p)] == []
    assert portutil.listening(saved["ports"]) == []
    assert not Path(saved["work_dir"]).exists() and not state.exists()
