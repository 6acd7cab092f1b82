"""End-to-end: the operator against the real control plane and kwok GPU nodes.

Why: the operator's promises are Kubernetes behaviour — children on the right nodes with the right GPU
requests, status and printer columns, gang restarts, garbage collection — so they are checked against a
real kube-apiserver, controller-manager (GC), scheduler and kwok kubelets, with the operator running
in-process (kopf.testing.KopfRunner, standalone, all namespaces). kwok pods run no process, so the tests
play the driver: they patch the `<job>-progress` ConfigMap exactly as the driver would.

Covers: every example reconciles (children, nodes, GPU requests, NVLink packing); the transport choice
for one fixture per topology; preflight pass and fail; an engine failure and a trainer rank failure
recover (gang restart) and the restart limit fails the job; a rank pod deleted mid-run restarts the
gang; a DELETE's answer read after the pod's DELETED event leaves no ghost rank; nor does a pod deleted
while the pod watch was broken (410 Gone, then kopf's re-list); the operator stopped mid-reconcile and
restarted leaves no duplicates; suspend/resume; deleting the job removes everything; `kubectl get rljobs` shows the columns; a gang scheduler whose CRDs are
missing is a condition, and installed ones get their pod group.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lockstep.api import TRANSPORT_KEY, TransportChoice
from lockstep_operator.k8s.client import Credentials, KubeClient, load_credentials
from lockstep_operator.reconcile import Key, dispatch

from e2e.controlplane.cluster import ControlPlane
from e2e.controlplane.nodes import NodePool
from e2e.operator_runner import Operator

ROOT = Path(__file__).resolve().parent.parent
JOB = "rl.lockstep.dev/job"
WAIT = 60.0


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def operator(cluster: ControlPlane) -> Iterator[Operator]:
    """CRDs installed, the operator running for the whole module."""
    os.environ.setdefault("LOCKSTEP_OPERATOR_RESYNC_SECONDS", "3")
    os.environ.setdefault("LOCKSTEP_OPERATOR_HA_MODE", "standalone")
    import lockstep_operator.handlers as handlers
    from lockstep_operator.settings import OperatorSettings

    # Settings of this run (the module may have been imported earlier with the defaults): a short
    # autoscaling window and cooldown so the autoscaler acts within a test.
    handlers.SETTINGS = OperatorSettings(
        ha_mode="standalone", autoscale_window_seconds=2, autoscale_cooldown_seconds=3
    )
    crd_files = sorted((ROOT / "crds").glob("rl.lockstep.dev_*.yaml"))  # not the kustomization
    for crd in crd_files:
        cluster.apply(crd.read_text())
    for crd in crd_files:
        name = yaml.safe_load(crd.read_text())["metadata"]["name"]
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    op = Operator()
    op.start()
    yield op
    op.stop()


def example(name: str, **patch: Any) -> dict[str, Any]:
    """An example manifest with nested overrides, e.g. spec={"placement": {"gang": {"scheduler": "none"}}}."""
    manifest: dict[str, Any] = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    _merge(manifest, patch)
    return manifest


def _merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def tiny(name: str, **spec: Any) -> dict[str, Any]:
    """A CPU-only job (reference engine, CPU trainer) named `name`."""
    return example("tiny-local", metadata={"name": name}, spec=spec)


def no_gang(manifest: dict[str, Any]) -> dict[str, Any]:
    _merge(manifest, {"spec": {"placement": {"gang": {"scheduler": "none"}}}})
    return manifest


def pods(cluster: ControlPlane, ns: str, job: str, role: str | None = None) -> list[dict[str, Any]]:
    sel = f"{JOB}={job}" + (f",rl.lockstep.dev/role={role}" if role else "")
    items: list[dict[str, Any]] = cluster.get("pods", "-n", ns, "-l", sel)["items"]
    return items


def running(cluster: ControlPlane, ns: str, job: str, role: str, count: int) -> list[dict[str, Any]]:
    """Wait until exactly `count` live pods of `role` are Running; return them."""

    def check() -> list[dict[str, Any]] | None:
        live = [p for p in pods(cluster, ns, job, role) if not p["metadata"].get("deletionTimestamp")]
        ok = len(live) == count and all(p["status"].get("phase") == "Running" for p in live)
        return live if ok else None

    try:
        live = cluster.wait_for(check, timeout=WAIT, what=f"{count} running {role} pods of {job}")
        assert live is not None
        return live
    except TimeoutError as err:
        seen = [(p["metadata"]["name"], p["status"].get("phase"), [c.get("message") for c in p["status"].get("conditions", [])])
                for p in pods(cluster, ns, job, role)]  # fmt: skip
        raise TimeoutError(f"{err}; pods: {seen}; job status: {status(cluster, ns, 'rljob', job)}") from None


def status(cluster: ControlPlane, ns: str, kind: str, name: str) -> dict[str, Any]:
    result: dict[str, Any] = cluster.get(kind, name, "-n", ns).get("status") or {}
    return result


def _replaced(cluster: ControlPlane, ns: str, job: str, first: dict[str, str]) -> bool:
    """Whether every rank of `first` (pod name -> uid) runs again under a new uid: rank 1 replaced
    too, one new world."""
    now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in running(cluster, ns, job, "trainer", 2)}
    return all(now[n] != first[n] for n in first)


def wait_status(
    cluster: ControlPlane,
    ns: str,
    kind: str,
    name: str,
    pred: Callable[[dict[str, Any]], Any],
    what: str,
    timeout: float = WAIT,
) -> dict[str, Any]:
    """Wait until `pred(status)` holds for the object's status; return that status."""

    def check() -> dict[str, Any] | None:
        st = status(cluster, ns, kind, name)
        return st if pred(st) else None

    got = cluster.wait_for(check, timeout=timeout, what=what)
    assert got is not None
    return got


def channel_story(cluster: ControlPlane, ns: str, job: str) -> str:
    """What a pass of the job's WeightChannel saw and did: its status, where the pods are, and the
    operator's own counts of WeightChannel passes and errors (the in-process operator's metrics)."""
    from lockstep_operator import metrics

    placed = [
        (p["metadata"]["name"], p["spec"].get("nodeName"), p["status"].get("phase"))
        for p in pods(cluster, ns, job)
    ]
    counts = {
        s.name.removeprefix("lockstep_operator_") + str(sorted(s.labels.values())): s.value
        for family in (metrics.RECONCILES, metrics.ERRORS, metrics.RETRIES)
        for s in family.collect()[0].samples
        if s.labels.get("kind") == "WeightChannel" and s.name.endswith("_total")
    }
    return f"status {status(cluster, ns, 'weightchannel', f'{job}-weights')}; pods {placed}; passes {counts}"


def phase_is(cluster: ControlPlane, ns: str, job: str, phase: str) -> dict[str, Any]:
    return wait_status(
        cluster, ns, "rljob", job, lambda s: s.get("phase") == phase, f"rljob {job} phase {phase}"
    )


def report(cluster: ControlPlane, ns: str, job: str, **doc: Any) -> None:
    """Act as the driver: write the progress document (the only thing the driver may patch)."""
    patch = {"data": {"progress.json": json.dumps(doc)}}
    cluster.kubectl(
        "patch", "configmap", f"{job}-progress", "-n", ns, "--type=merge", "-p", json.dumps(patch)
    )


def cond(st: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions", []) if c["type"] == type_), {})


def gpus(pod: dict[str, Any]) -> str | None:
    limits: dict[str, str] = pod["spec"]["containers"][0].get("resources", {}).get("limits", {})
    return limits.get("nvidia.com/gpu")


def node_labels(cluster: ControlPlane, node: str) -> dict[str, str]:
    labels: dict[str, str] = cluster.get("node", node)["metadata"]["labels"]
    return labels


def shared_volume(cluster: ControlPlane, ns: str, claim: str) -> None:
    """A ReadWriteMany claim bound to a static PersistentVolume (kwok pods never touch it)."""
    pv = {
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-{claim}"},
        "spec": {"capacity": {"storage": "1Ti"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "hostPath": {"path": "/tmp/lockstep-shared"}, "persistentVolumeReclaimPolicy": "Delete"},
    }  # fmt: skip
    pvc = {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": ns},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": f"{ns}-{claim}",
                 "resources": {"requests": {"storage": "1Ti"}}},
    }  # fmt: skip
    cluster.apply([pv, pvc])


def delete_and_wait(cluster: ControlPlane, ns: str, job: str) -> None:
    cluster.kubectl("delete", "rljob", job, "-n", ns, "--wait=false")
    cluster.wait_for(lambda: not pods(cluster, ns, job), timeout=WAIT, what=f"pods of {job} gone")


# --------------------------------------------------------------------------------------------- tests


def test_h100_example_children_nodes_gpus_and_columns(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    job = "qwen3-4b-h100"
    cluster.apply(no_gang(example("h100")), namespace=namespace)
    engines = running(cluster, namespace, job, "engine", 8)
    ranks = running(cluster, namespace, job, "trainer", 1)
    running(cluster, namespace, job, "driver", 1)
    for pod in [*engines, *ranks]:
        labels = node_labels(cluster, pod["spec"]["nodeName"])
        assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert {gpus(p) for p in engines} == {"1"} and gpus(ranks[0]) == "8"
    env = {e["name"]: e.get("value") for e in ranks[0]["spec"]["containers"][0]["env"]}
    assert env["MASTER_ADDR"] == f"{job}-trainer-0.{job}-trainer.{namespace}.svc"
    assert (env["WORLD_SIZE"], env["RANK"], env["NPROC_PER_NODE"]) == ("1", "0", "8")
    # Trainer ranks take the RL steps: rank 0 serves the driver on `control`, ranks push to the router.
    assert ranks[0]["spec"]["containers"][0]["command"][-1] == "--serve"
    assert {"name": "control", "containerPort": 29600, "protocol": "TCP"} in ranks[0]["spec"]["containers"][
        0
    ]["ports"]
    assert env["LOCKSTEP_ROUTER_URL"] == f"http://{job}-rollout-router:30000"
    driver = pods(cluster, namespace, job, "driver")[0]
    driver_env = {e["name"]: e.get("value") for e in driver["spec"]["containers"][0]["env"]}
    assert driver_env["LOCKSTEP_TRAINER_URL"] == f"http://{job}-trainer-0.{job}-trainer.{namespace}.svc:29600"
    services = {s["metadata"]["name"]: s for s in cluster.get("services", "-n", namespace)["items"]}
    assert services[f"{job}-trainer"]["spec"]["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in services[f"{job}-trainer"]["spec"]["ports"]} == {
        "rendezvous": 29500,
        "control": 29600,
    }
    policy = cluster.get("networkpolicy", f"{job}-trainer", "-n", namespace)["spec"]
    control = [r for r in policy["ingress"] if {"protocol": "TCP", "port": 29600} in r["ports"]]
    assert [r["from"][0]["podSelector"]["matchLabels"]["rl.lockstep.dev/role"] for r in control] == ["driver"]
    assert services[f"{job}-rollout-router"]["spec"]["ports"][0]["port"] == 30000
    # The job's key: one random Secret owned by the job, referenced (never copied) by every pod.
    secret = cluster.get("secret", f"{job}-api-key", "-n", namespace)
    assert len(base64.b64decode(secret["data"]["api-key"])) >= 43
    assert secret["metadata"]["ownerReferences"][0]["name"] == job
    ref = {"name": f"{job}-api-key", "key": "api-key"}
    for pod in [driver, ranks[0], engines[0]]:
        keyed = [e for e in pod["spec"]["containers"][0]["env"] if e["name"] == "LOCKSTEP_API_KEY"]
        assert [e["valueFrom"]["secretKeyRef"] for e in keyed] == [ref], pod["metadata"]["name"]
    assert cluster.get("networkpolicy", f"{job}-rollout", "-n", namespace)["spec"]["podSelector"]
    driver_ingress = cluster.get("networkpolicy", f"{job}-driver", "-n", namespace)["spec"].get("ingress")
    assert driver_ingress == [{"ports": [{"protocol": "TCP", "port": 9400}]}]  # the metrics port only
    # The namespace's baseline came before any pod (the job's own policies may follow them).
    baseline = cluster.get("networkpolicy", "lockstep-job-pods", "-n", namespace)
    assert baseline["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 9400}]}]
    assert not baseline["metadata"].get("ownerReferences")  # it serves every job of the namespace
    first_pod = min(p["metadata"]["creationTimestamp"] for p in [driver, *ranks, *engines])
    assert baseline["metadata"]["creationTimestamp"] <= first_pod
    for kind in ("rolloutpool", "trainergroup", "weightchannel"):
        owners = cluster.get(kind, "-n", namespace)["items"][0]["metadata"]["ownerReferences"]
        assert owners[0]["kind"] == "RLJob" and owners[0]["name"] == job
    st = phase_is(cluster, namespace, job, "Preflight")  # checkWeightUpdateEqual: true
    meta = cluster.get("rljob", job, "-n", namespace)["metadata"]
    assert not [k for k in meta.get("annotations", {}) if k.startswith("kopf")]  # no kopf bookkeeping
    assert meta.get("finalizers", []) in ([], ["rl.lockstep.dev/finalizer"])
    assert st["transport"] == "broadcast"  # requested and feasible (one network)
    versions = {p["metadata"]["name"]: 4 for p in engines}
    report(
        cluster,
        namespace,
        job,
        step=0,
        weightVersion=0,
        engineVersions={n: 0 for n in versions},
        preflight="passed",
    )
    phase_is(cluster, namespace, job, "Running")
    report(
        cluster,
        namespace,
        job,
        step=4,
        weightVersion=4,
        reward=0.625,
        staleness=1,
        queueSize=3,
        engineVersions=versions,
        preflight="passed",
    )
    cluster.wait_for(
        lambda: status(cluster, namespace, "rljob", job).get("weightVersion") == 4,
        timeout=WAIT,
        what="weightVersion 4 folded into the job",
    )
    table = cluster.kubectl("get", "rljobs", "-n", namespace).stdout.splitlines()
    assert table[0].split()[:7] == ["NAME", "PHASE", "STEP", "VERSION", "REWARD", "STALENESS", "TRANSPORT"]
    assert table[1].split()[:7] == [job, "Running", "4", "4", "0.625", "1", "broadcast"]
    assert "AGE" in table[0]
    delete_and_wait(cluster, namespace, job)


def test_gb300_example_packs_trainer_into_one_nvlink_domain(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    job = example("glm5-gb300")["metadata"]["name"]
    cluster.apply(no_gang(example("glm5-gb300")), namespace=namespace)
    ranks = running(cluster, namespace, job, "trainer", 8)
    engines = running(cluster, namespace, job, "engine", 8)
    cliques = {node_labels(cluster, p["spec"]["nodeName"]).get("nvidia.com/gpu.clique") for p in ranks}
    assert len(cliques) == 1 and None not in cliques
    assert {gpus(p) for p in [*ranks, *engines]} == {"4"}
    for pod in [*ranks, *engines]:
        assert node_labels(cluster, pod["spec"]["nodeName"])["nvidia.com/gpu.product"] == "NVIDIA-GB300"
    cmd = engines[0]["spec"]["containers"][0]["command"]
    assert cmd[4:7] == ["python3", "-m", "sglang.launch_server"] and "--attn-dp-size" in cmd
    assert cmd[:4] == ["python3", "-m", "lockstep.observability.sglang_start", "--"]  # the key: --config
    # FP8 serving: each engine pod pulls the hub checkpoint, converts it, and serves the conversion
    inits = engines[0]["spec"]["initContainers"]
    assert [c["name"] for c in inits] == ["pull-model", "convert-model"]
    convert = inits[1]["command"]
    assert convert[:2] == ["lockstep", "convert-model"] and convert[convert.index("--precision") + 1] == "fp8"
    served = convert[convert.index("--dest") + 1]
    assert cmd[cmd.index("--model-path") + 1] == served and cmd[cmd.index("--quantization") + 1] == "fp8"
    for rank in ranks:  # the trainer keeps (and trains) the BF16 checkpoint
        assert [c["name"] for c in rank["spec"]["initContainers"]] == ["pull-model"]
    assert len({p["spec"]["nodeName"] for p in ranks}) == 8  # one rank pod per tray
    delete_and_wait(cluster, namespace, job)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("p2p", "p2p"),
        ("broadcast", "broadcast"),
        ("colocated-cpu", "broadcast"),
        ("disk-delta", "disk-delta"),
    ],
)
def test_transport_choice_per_topology(
    cluster: ControlPlane, operator: Operator, namespace: str, case: str, expected: str
) -> None:
    job = f"topo-{case}"
    two_by_two = {
        "trainer": {"device": "cuda", "nodes": 2, "gpusPerNode": 4},
        "rollout": {"replicas": 2, "gpusPerEngine": 4},
    }
    if case == "p2p":  # GB300 trays: rdma/ib on every node, 2 nodes per side
        spec: dict[str, Any] = {**two_by_two, "placement": {"gpuProduct": "GB300"}}
    elif case == "broadcast":  # Ethernet-only H100 nodes: one network, no RDMA
        spec = {
            # Whole nodes each (two 8-GPU nodes): smaller engines may be spread over both nodes by
            # the scheduler and leave no node with 8 free GPUs for the trainer.
            "trainer": {"device": "cuda", "nodes": 1, "gpusPerNode": 8},
            "rollout": {"replicas": 1, "gpusPerEngine": 8},
            "placement": {
                "gpuProduct": "H100",
                "nodeSelector": {"node.kubernetes.io/instance-type": "hgx-h100-eth"},
            },
        }
    elif case == "colocated-cpu":  # CPU pods share no device memory: not cuda-ipc, and the reason says so
        spec = {"schedule": {"colocate": True}}
    else:  # two nodes on different networks, only a shared volume between them
        cluster.add_nodes(
            [
                NodePool(
                    prefix="lsop-split",
                    count=2,
                    capacity={"cpu": "64", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "8"},
                    labels={"lockstep-e2e/split": "true"},
                    taints=[{"key": "lockstep-e2e/split", "value": "true", "effect": "NoSchedule"}],
                    per_node_labels=[
                        {"from": 0, "to": 1, "labels": {"rl.lockstep.dev/network": "net-a"}},
                        {"from": 1, "to": 2, "labels": {"rl.lockstep.dev/network": "net-b"}},
                    ],
                )
            ]
        )
        spec = {
            "trainer": {"device": "cuda", "nodes": 1, "gpusPerNode": 8},
            "rollout": {"replicas": 1, "gpusPerEngine": 8},
            "weightSync": {"diskDelta": {"volumeClaim": "shared-ckpt"}},
            "placement": {
                "nodeSelector": {"lockstep-e2e/split": "true"},
                "tolerations": [{"key": "lockstep-e2e/split", "operator": "Exists", "effect": "NoSchedule"}],
            },
        }
        shared_volume(cluster, namespace, "shared-ckpt")
    cluster.apply(tiny(job, **spec), namespace=namespace)
    st = chosen_transport(cluster, namespace, job)
    assert st["transport"] == expected, st["reason"]
    assert st["reason"]
    if case == "colocated-cpu":
        assert st["reason"].startswith("colocated on CPU: the engine and trainer pods share no device memory")
    job_status = wait_status(
        cluster, namespace, "rljob", job, lambda s: s.get("transport"), "transport folded into the job"
    )
    assert job_status["transport"] == expected and job_status["transportReason"] == st["reason"]
    # The ranks learn it from the job's config ConfigMap (transport.json next to job.yaml), written in
    # the same pass that folded it into the job status; parsed by the runtime's own reader.
    data = cluster.get("configmap", f"{job}-config", "-n", namespace)["data"]
    choice = TransportChoice.model_validate_json(data[TRANSPORT_KEY])
    assert (choice.transport, choice.reason) == (expected, st["reason"]), data[TRANSPORT_KEY]
    assert "job.yaml" in data
    delete_and_wait(cluster, namespace, job)
    if case == "disk-delta":
        cluster.kubectl("delete", "node", "lsop-split-0", "lsop-split-1", "--wait=false")


def test_a_jobs_ranks_and_engines_land_in_one_network_domain(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    """CPU jobs fit on every kwok node, 9 in zone-a and 18 in zone-b: left to the resource scores the
    scheduler split a job's ranks and engines over both zones, where no transport is feasible (none is
    ever chosen). Their preferred pod affinity (resources.pods.network_affinity) keeps each job in one
    zone, and each gets a transport."""
    jobs = [f"zones-{i}" for i in range(4)]
    for job in jobs:
        cluster.apply(tiny(job, trainer={"nodes": 2}, rollout={"replicas": 2}), namespace=namespace)
    zones = {}
    for job in jobs:
        placed = running(cluster, namespace, job, "trainer", 2) + running(
            cluster, namespace, job, "engine", 2
        )
        zones[job] = {
            node_labels(cluster, p["spec"]["nodeName"])["topology.kubernetes.io/zone"] for p in placed
        }
    assert all(len(z) == 1 for z in zones.values()), zones
    for job in jobs:
        wait_status(
            cluster, namespace, "weightchannel", f"{job}-weights", lambda s: s.get("transport"), f"{job}'s transport"
        )  # fmt: skip


def test_gpu_colocation_is_refused_with_the_reason(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    """Engines and ranks are separate pods with their own GPUs: CUDA IPC could never work as rendered,
    so a GPU job with schedule.colocate fails at once naming the field and the fix, and starts nothing."""
    job = "coloc-gpu"
    spec = {
        "schedule": {"colocate": True},
        "trainer": {"device": "cuda", "nodes": 1, "gpusPerNode": 8},
        "rollout": {"replicas": 1, "gpusPerEngine": 8},
        "placement": {"gpuProduct": "H100"},
    }
    cluster.apply(tiny(job, **spec), namespace=namespace)
    st = phase_is(cluster, namespace, job, "Failed")
    failed = cond(st, "Failed")
    assert failed["reason"] == "InvalidSpec", failed
    assert failed["message"].startswith(
        "spec.schedule.colocate: the operator renders engines and trainer ranks"
    )
    assert "set schedule.colocate to false" in failed["message"]
    assert pods(cluster, namespace, job) == []
    delete_and_wait(cluster, namespace, job)


def chosen_transport(cluster: ControlPlane, namespace: str, job: str) -> dict[str, Any]:
    """The job's WeightChannel status once it names a transport; a timeout says where the pods landed."""
    try:
        return wait_status(
            cluster,
            namespace,
            "weightchannel",
            f"{job}-weights",
            lambda s: s.get("transport"),
            f"transport of {job}",
        )
    except TimeoutError as err:
        seen = [
            (p["metadata"]["name"], p["status"].get("phase"), p["spec"].get("nodeName"))
            for p in pods(cluster, namespace, job)
        ]
        channel = status(cluster, namespace, "weightchannel", f"{job}-weights")
        raise TimeoutError(f"{err}; pods: {seen}; channel: {channel}") from None


def test_infeasible_requested_transport_is_a_condition(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    """p2p requested where it cannot work: the automatic choice (broadcast) is used and the condition
    says why p2p was refused.

    Pinned to zone-a: with p2p requested the ranks request an RDMA device (rdma/ib), so unpinned they
    land only on RDMA nodes (h100-ib in zone-a or gb300 in zone-b) while the engine lands on any node;
    a rank on gb300 and the engine in zone-a share no network, no transport is feasible and none is
    ever chosen (the flake this test had). In zone-a the only RDMA nodes are h100-ib, one network."""
    job = "want-p2p"
    zone_a = {"nodeSelector": {"topology.kubernetes.io/zone": "zone-a"}}
    cluster.apply(
        tiny(job, weightSync={"transport": "p2p", "checkWeightUpdateEqual": False}, placement=zone_a),
        namespace=namespace,
    )
    st = chosen_transport(cluster, namespace, job)
    feasible = cond(st, "RequestedTransportFeasible")
    assert feasible["status"] == "False" and "p2p" in feasible["message"], st
    assert st["transport"] == "broadcast", st


def test_preflight_failure_fails_the_job_naming_tensors(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    job = "preflight-bad"
    cluster.apply(tiny(job), namespace=namespace)
    running(cluster, namespace, job, "driver", 1)
    phase_is(cluster, namespace, job, "Preflight")
    report(
        cluster,
        namespace,
        job,
        step=0,
        weightVersion=0,
        preflight="failed",
        preflightMismatched=["model.layers.0.mlp.up_proj.weight", "lm_head.weight"],
    )
    st = phase_is(cluster, namespace, job, "Failed")
    failed = cond(st, "Failed")
    assert failed["reason"] == "PreflightFailed" and "model.layers.0.mlp.up_proj.weight" in failed["message"]
    # The channel's status is written by its own reconcile, which may land after the job's.
    channel = wait_status(
        cluster,
        namespace,
        "weightchannel",
        f"{job}-weights",
        lambda s: s.get("preflightPassed") is not None,
        "preflight folded into the weight channel",
    )
    assert channel["preflightPassed"] is False and cond(channel, "PreflightPassed")["status"] == "False"
    # A failed job frees its GPUs: engine and trainer pods go away.
    cluster.wait_for(
        lambda: not pods(cluster, namespace, job, "engine") and not pods(cluster, namespace, job, "trainer"),
        timeout=WAIT,
        what="pods of the failed job deleted",
    )


def test_engine_version_gates_readiness(cluster: ControlPlane, operator: Operator, namespace: str) -> None:
    job = "versions"
    cluster.apply(tiny(job, rollout={"replicas": 2}), namespace=namespace)
    engines = running(cluster, namespace, job, "engine", 2)
    names = sorted(p["metadata"]["name"] for p in engines)
    report(
        cluster,
        namespace,
        job,
        step=2,
        weightVersion=2,
        engineVersions={names[0]: 2, names[1]: 1},
        preflight="passed",
    )
    pool = wait_status(
        cluster,
        namespace,
        "rolloutpool",
        f"{job}-rollout",
        lambda s: s.get("readyReplicas") == 1,
        "one engine ready (the other lags a version)",
    )
    assert (
        cond(pool, "WeightsSynced")["status"] == "False"
        and names[1] in cond(pool, "WeightsSynced")["message"]
    )
    assert [e.get("weightVersion") for e in pool["engines"]] == [2, 1]
    report(
        cluster,
        namespace,
        job,
        step=2,
        weightVersion=2,
        engineVersions={names[0]: 2, names[1]: 2},
        preflight="passed",
    )
    cluster.wait_for(
        lambda: status(cluster, namespace, "rolloutpool", f"{job}-rollout").get("readyReplicas") == 2,
        timeout=WAIT,
        what="both engines ready at version 2",
    )
    # The driver knows addresses, not pod names: it asks every address of the headless engines
    # Service (not-ready engines included) and reports `<pod IP>:30000`.
    engines_svc = cluster.get("service", f"{job}-rollout-engines", "-n", namespace)["spec"]
    assert engines_svc["clusterIP"] == "None" and engines_svc["publishNotReadyAddresses"] is True
    ips = {p["metadata"]["name"]: p["status"]["podIP"] for p in running(cluster, namespace, job, "engine", 2)}
    report(
        cluster,
        namespace,
        job,
        step=3,
        weightVersion=3,
        engineAddressVersions={f"{ips[names[0]]}:30000": 3, f"{ips[names[1]]}:30000": 2},
        preflight="passed",
    )

    def gate(pod: str) -> str | None:
        """The readiness-gate condition the operator sets on the engine pod."""
        got = cluster.get("pod", pod, "-n", namespace)
        assert got["spec"]["readinessGates"] == [{"conditionType": "rl.lockstep.dev/weights-current"}]
        return cond(got["status"], "rl.lockstep.dev/weights-current").get("status")

    cluster.wait_for(
        lambda: gate(names[1]) == "False" and gate(names[0]) == "True",
        timeout=WAIT,
        what="the lagging engine's readiness gate False, the current one's True",
    )
    cluster.wait_for(  # written by the same pass, after the gate
        lambda: status(cluster, namespace, "rolloutpool", f"{job}-rollout").get("readyReplicas") == 1,
        timeout=WAIT,
        what="one engine ready (the other lags, reported by address)",
    )


def test_engine_failure_is_replaced(cluster: ControlPlane, operator: Operator, namespace: str) -> None:
    job = "engine-fail"
    cluster.apply(tiny(job, rollout={"replicas": 2}), namespace=namespace)
    before = {
        p["metadata"]["name"]: p["metadata"]["uid"] for p in running(cluster, namespace, job, "engine", 2)
    }
    victim = sorted(before)[1]
    cluster.kubectl("label", "pod", victim, "-n", namespace, "lockstep.dev/inject-failure=container")
    cluster.wait_for(
        lambda: (
            {
                p["metadata"]["name"]: p["metadata"]["uid"]
                for p in running(cluster, namespace, job, "engine", 2)
            }.get(victim)
            not in (None, before[victim])
        ),
        timeout=WAIT,
        what="the failed engine replaced by a new pod",
    )


def fail_rank_1_and_wait_for_a_new_gang(cluster: ControlPlane, namespace: str, job: str) -> None:
    """Rank 1's container fails (kwok's injected failure); wait until both ranks are new pods: rank 0
    restarted too, the whole gang."""
    first = {
        p["metadata"]["name"]: p["metadata"]["uid"] for p in running(cluster, namespace, job, "trainer", 2)
    }
    cluster.kubectl(
        "label", "pod", f"{job}-trainer-1", "-n", namespace, "lockstep.dev/inject-failure=container"
    )

    cluster.wait_for(
        lambda: _replaced(cluster, namespace, job, first), timeout=WAIT, what="both ranks recreated"
    )


def test_trainer_rank_failure_restarts_the_gang_then_fails_at_the_limit(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    job = "gang"
    manifest = tiny(job, trainer={"nodes": 2}, backoffLimit=1)
    cluster.apply(manifest, namespace=namespace)
    fail_rank_1_and_wait_for_a_new_gang(cluster, namespace, job)
    cluster.wait_for(
        lambda: status(cluster, namespace, "trainergroup", f"{job}-trainer").get("restarts") == 1,
        timeout=WAIT,
        what="one gang restart counted",
    )
    cluster.kubectl(
        "annotate", "pod", f"{job}-trainer-0", "-n", namespace, "lockstep.dev/failure-message=NCCL timeout"
    )
    cluster.kubectl(
        "label", "pod", f"{job}-trainer-0", "-n", namespace, "lockstep.dev/inject-failure=container"
    )
    st = phase_is(cluster, namespace, job, "Failed")
    failed = cond(st, "Failed")
    assert failed["reason"] == "GangRestartLimitExceeded" and "rank 0" in failed["message"]
    assert "NCCL timeout" in failed["message"]


def test_trainer_rank_pod_deleted_mid_run_restarts_the_gang(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    """A deleted rank pod is a gang fault: a replacement alone would wait in the rendezvous for a
    world that is gone (its peer exits when its rank 0 goes). kwok removes the pod at once, so the
    reconcile sees the rank missing beside the live rank 1: the gang restarts, counted and named."""
    job = "gang-deleted"
    cluster.apply(tiny(job, trainer={"nodes": 2}), namespace=namespace)
    first = {
        p["metadata"]["name"]: p["metadata"]["uid"] for p in running(cluster, namespace, job, "trainer", 2)
    }
    group = f"{job}-trainer"

    def complete() -> bool:  # the reconcile recorded that every rank of generation 0 was created
        meta = cluster.get("trainergroup", group, "-n", namespace)["metadata"]
        return (meta.get("annotations") or {}).get("rl.lockstep.dev/gang-complete") == "0"

    cluster.wait_for(complete, timeout=WAIT, what="generation 0 recorded as complete")
    cluster.kubectl("delete", "pod", f"{group}-0", "-n", namespace, "--wait=false")

    cluster.wait_for(
        lambda: _replaced(cluster, namespace, job, first), timeout=WAIT, what="both ranks recreated"
    )
    st = wait_status(cluster, namespace, "trainergroup", group, lambda s: s.get("restarts") == 1, "1 restart")
    assert st["restarts"] == 1, st

    def named() -> bool:
        found = cluster.get("events", "-n", namespace, "--field-selector", "reason=GangRestart")["items"]
        return any("rank 0's pod was deleted" in e["message"] for e in found)

    cluster.wait_for(named, timeout=WAIT, what="a GangRestart event naming the deleted rank")


def test_a_delete_answer_read_after_its_event_leaves_no_ghost_rank(
    cluster: ControlPlane, operator: Operator, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API server answers the DELETE of a Failed pod and sends its DELETED event at the same moment,
    on two connections; a busy operator may read the answer second. That late copy once went back into
    the read cache, where no event would remove it: the gang restart waited for the ghost rank for ever
    (`pods: []`). Here every DELETE answer is read 0.2 s late, after the event (k8s/store.py)."""
    once = KubeClient._once

    async def late(self: KubeClient, method: str, path: str, *args: Any) -> Any:
        answer = await once(self, method, path, *args)
        if method == "DELETE":
            await asyncio.sleep(0.2)
        return answer

    monkeypatch.setattr(KubeClient, "_once", late)
    job = "gang-late"
    cluster.apply(tiny(job, trainer={"nodes": 2}), namespace=namespace)
    fail_rank_1_and_wait_for_a_new_gang(cluster, namespace, job)


def test_a_pod_deleted_while_the_watch_was_broken_leaves_no_ghost_rank(
    cluster: ControlPlane, operator: Operator, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watch that breaks and comes back with 410 Gone (the API server restarted, or the watch's
    version was compacted during a long disconnect) makes kopf list the kind again; a pod deleted in
    the gap sends no DELETED event, and the read cache kept it for ever: the gang of a rank deleted in
    the gap never restarted. The cache re-lists each kind itself and drops what the list lacks
    (k8s/relist.py, docs/operator.md "The read cache"). Here the pods' watch loses every event while
    `gap` is set, then answers 410 as the API server would: kopf's own re-list follows."""
    from kopf._cogs.clients import watching

    real = watching.watch_objs
    gap, resume = threading.Event(), threading.Event()

    async def broken(*, resource: Any, **kwargs: Any) -> Any:
        async for event in real(resource=resource, **kwargs):
            if resource.plural != "pods" or not (gap.is_set() or resume.is_set()):
                yield event
            elif resume.is_set():  # the first event after the gap: the watch's version is gone
                resume.clear()
                yield {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}
                return

    monkeypatch.setattr(watching, "watch_objs", broken)
    operator.restart()  # its watches go through `broken`
    job = "gang-gap"
    cluster.apply(tiny(job, trainer={"nodes": 2}), namespace=namespace)
    first = {
        p["metadata"]["name"]: p["metadata"]["uid"] for p in running(cluster, namespace, job, "trainer", 2)
    }
    group = f"{job}-trainer"

    def complete() -> bool:  # every rank of generation 0 was created: a missing rank is a deletion
        meta = cluster.get("trainergroup", group, "-n", namespace)["metadata"]
        return (meta.get("annotations") or {}).get("rl.lockstep.dev/gang-complete") == "0"

    cluster.wait_for(complete, timeout=WAIT, what="generation 0 recorded as complete")
    gap.set()
    cluster.kubectl("delete", "pod", f"{group}-0", "-n", namespace, "--wait=false")
    cluster.wait_for(
        lambda: f"{group}-0" not in {p["metadata"]["name"] for p in pods(cluster, namespace, job, "trainer")},
        timeout=WAIT,
        what="rank 0's pod gone (its events lost in the gap)",
    )
    gap.clear()
    resume.set()
    # An event on the pods' watch. The operator may have restarted the gang already (its own re-list or
    # its job's periodic re-check can find rank 0 gone first), deleting rank 1: then the new gang's pods
    # are the events, and the annotation has nothing to touch.
    touch = ["annotate", "pod", f"{group}-1", "-n", namespace, "e2e.lockstep.dev/touch=1", "--overwrite"]
    touched = cluster.kubectl(*touch, check=False)
    assert touched.returncode == 0 or "NotFound" in touched.stderr, touched.stderr

    cluster.wait_for(
        lambda: _replaced(cluster, namespace, job, first),
        timeout=WAIT,
        what="both ranks recreated after the gap",
    )
    assert not resume.is_set()  # the 410 was sent: kopf listed the pods again


def test_suspend_scales_to_zero_and_resume_restores(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    job = "pause"
    cluster.apply(tiny(job, rollout={"replicas": 2}), namespace=namespace)
    running(cluster, namespace, job, "engine", 2)
    cluster.kubectl("patch", "rljob", job, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    phase_is(cluster, namespace, job, "Suspended")
    cluster.wait_for(lambda: not pods(cluster, namespace, job), timeout=WAIT, what="no pods while suspended")
    assert cluster.get("rolloutpool", f"{job}-rollout", "-n", namespace)["spec"]["replicas"] == 2
    cluster.kubectl(
        "patch", "rljob", job, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":false}}'
    )
    running(cluster, namespace, job, "engine", 2)
    running(cluster, namespace, job, "trainer", 1)


def test_scale_subresource_is_honoured(cluster: ControlPlane, operator: Operator, namespace: str) -> None:
    job = "scaled"
    cluster.apply(tiny(job), namespace=namespace)
    running(cluster, namespace, job, "engine", 1)
    cluster.kubectl("scale", "rolloutpool", f"{job}-rollout", "-n", namespace, "--replicas=3")
    running(cluster, namespace, job, "engine", 3)
    pool = wait_status(
        cluster,
        namespace,
        "rolloutpool",
        f"{job}-rollout",
        lambda s: s.get("replicas") == 3,
        "status.replicas 3",
    )
    assert pool["selector"] and f"{JOB}={job}" in pool["selector"]


def test_a_child_deleted_by_hand_comes_back_at_once(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    """The apply cache trusts an unchanged child for apply_refresh_seconds (600 s here too), so the
    re-check (every 3 s here) alone would not send it again: a child's DELETED event drops its cache
    entry and kicks its job, whose next pass applies it again, and its ranks follow."""
    job = "deleted-child"
    cluster.apply(tiny(job), namespace=namespace)
    running(cluster, namespace, job, "trainer", 1)
    uid = cluster.get("trainergroup", f"{job}-trainer", "-n", namespace)["metadata"]["uid"]
    cluster.kubectl("delete", "trainergroup", f"{job}-trainer", "-n", namespace)

    def again() -> bool:
        found = cluster.get("trainergroup", "-n", namespace, "-l", f"{JOB}={job}")["items"]
        return any(o["metadata"]["uid"] != uid for o in found)

    cluster.wait_for(again, timeout=WAIT, what="the TrainerGroup applied again")
    running(cluster, namespace, job, "trainer", 1)


def test_operator_restarted_mid_reconcile_leaves_no_duplicates(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    job = "restart"
    cluster.apply(tiny(job, rollout={"replicas": 3}, trainer={"nodes": 2}), namespace=namespace)
    cluster.wait_for(lambda: pods(cluster, namespace, job), timeout=WAIT, what="first pod created")
    operator.restart()  # killed while the job's children are being created
    running(cluster, namespace, job, "engine", 3)
    running(cluster, namespace, job, "trainer", 2)
    running(cluster, namespace, job, "driver", 1)
    assert len(pods(cluster, namespace, job)) == 6
    for kind in ("rolloutpool", "trainergroup", "weightchannel", "services", "configmaps"):
        names = [
            o["metadata"]["name"] for o in cluster.get(kind, "-n", namespace, "-l", f"{JOB}={job}")["items"]
        ]
        assert len(names) == len(set(names))
    assert len(cluster.get("rolloutpool", "-n", namespace)["items"]) == 1


def test_delete_removes_everything(cluster: ControlPlane, operator: Operator, namespace: str) -> None:
    job = "gone"
    cluster.apply(tiny(job), namespace=namespace)
    running(cluster, namespace, job, "driver", 1)
    cluster.kubectl("delete", "rljob", job, "-n", namespace, "--wait=false")

    def nothing_left() -> bool:
        kinds = (
            "pods,services,configmaps,serviceaccounts,roles,rolebindings,networkpolicies,"
            "rolloutpools,trainergroups,weightchannels"
        )
        return not cluster.get(kinds, "-n", namespace, "-l", f"{JOB}={job}")["items"]

    cluster.wait_for(nothing_left, timeout=WAIT, what="every child garbage-collected")
    cluster.wait_for(
        lambda: not cluster.get("rljobs", "-n", namespace)["items"], timeout=WAIT, what="the job itself gone"
    )


def test_driver_rbac_is_narrow(cluster: ControlPlane, operator: Operator, namespace: str) -> None:
    job = "rbac"
    cluster.apply(tiny(job), namespace=namespace)
    running(cluster, namespace, job, "driver", 1)
    sa = f"system:serviceaccount:{namespace}:{job}-driver"

    def can(*args: str) -> str:
        return cluster.kubectl(
            "auth", "can-i", *args, "-n", namespace, f"--as={sa}", check=False
        ).stdout.strip()

    # The pods come first in a pass and the RBAC after them (docs/operator.md, "Reconcile order"): on
    # kwok a pod is Running at once, so wait for the Role; what is checked is its narrowness.
    cluster.wait_for(
        lambda: can("patch", f"configmap/{job}-progress") == "yes", timeout=WAIT, what="the driver's Role"
    )
    assert can("patch", f"configmap/{job}-config") == "no"
    assert can("list", "pods") == "no"
    assert can("patch", f"rljob/{job}") == "no"


def test_missing_gang_scheduler_is_a_condition_and_installed_one_gets_a_pod_group(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    job = "gang-missing"
    cluster.apply(tiny(job, placement={"gang": {"scheduler": "scheduler-plugins"}}), namespace=namespace)
    st = wait_status(cluster, namespace, "rljob", job, lambda s: s.get("conditions"), "status")
    admitted = cond(st, "Admitted")
    assert admitted["status"] == "False" and "scheduler-plugins" in admitted["message"]
    assert st["phase"] == "Pending" and not pods(cluster, namespace, job)
    # Install a Kueue Workload API: plain pod groups need no object, only labels on the members.
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "workloads.kueue.x-k8s.io"},
        "spec": {"group": "kueue.x-k8s.io", "scope": "Namespaced",
                 "names": {"plural": "workloads", "singular": "workload", "kind": "Workload"},
                 "versions": [{"name": "v1beta1", "served": True, "storage": True,
                               "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
    }  # fmt: skip
    cluster.apply(crd)
    cluster.kubectl("wait", "--for=condition=Established", "crd/workloads.kueue.x-k8s.io", "--timeout=60s")
    job2 = "gang-kueue"
    cluster.apply(
        tiny(
            job2,
            trainer={"nodes": 2},
            rollout={"replicas": 3, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}},
            placement={"gang": {"scheduler": "kueue", "queueName": "rl"}},
        ),
        namespace=namespace,
    )
    ranks = running(cluster, namespace, job2, "trainer", 2)
    engines = running(cluster, namespace, job2, "engine", 3)
    members = [p for p in [*ranks, *engines] if "kueue.x-k8s.io/pod-group-name" in p["metadata"]["labels"]]
    assert len(members) == 3  # 2 ranks + 1 minimum replica
    assert {p["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] for p in members} == {"3"}
    assert all(p["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "rl" for p in [*ranks, *engines])


def test_pool_autoscales_from_the_queue_within_bounds(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    job = "autoscale"
    cluster.apply(tiny(job, rollout={"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 2}},
                       weightSync={"checkWeightUpdateEqual": False}), namespace=namespace)  # fmt: skip
    running(cluster, namespace, job, "engine", 1)

    steps = [0]

    def starving() -> bool:  # the driver reports an empty queue, one step per poll
        steps[0] += 1
        report(cluster, namespace, job, step=steps[0], weightVersion=steps[0], queueSize=0, queueCapacity=8)
        return bool(cluster.get("rolloutpool", f"{job}-rollout", "-n", namespace)["spec"]["replicas"] == 2)

    try:
        cluster.wait_for(starving, timeout=WAIT, what="pool scaled up to maxReplicas", interval=1.0)
    except TimeoutError as err:
        pool = cluster.get("rolloutpool", f"{job}-rollout", "-n", namespace)
        raise TimeoutError(f"{err}; pool annotations: {pool['metadata'].get('annotations')}") from None
    running(cluster, namespace, job, "engine", 2)
    for _ in range(6):  # still starving, but at maxReplicas: stays at 2
        starving()
    assert cluster.get("rolloutpool", f"{job}-rollout", "-n", namespace)["spec"]["replicas"] == 2


class CountingClient(KubeClient):
    """The operator's client, recording every request it sends to the API server."""

    def __init__(self, credentials: Credentials) -> None:
        super().__init__(credentials)
        self.sent: list[tuple[str, str]] = []

    async def request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        self.sent.append((method, path))
        return await super().request(method, path, **kwargs)


def test_a_second_pass_with_nothing_changed_writes_nothing(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    """Level-triggered passes cost no writes once converged: a client's passes over a settled job and
    its children (the four reconciles, against the real API server) send only reads the second time
    (the apply cache; a status written only when it changed; the Secret created once)."""
    job = "quiet"
    # In one zone: what this test checks does not depend on the scheduler keeping the job in one
    # network domain (test_a_jobs_ranks_and_engines_land_in_one_network_domain checks that).
    zone_a = {"nodeSelector": {"topology.kubernetes.io/zone": "zone-a"}}
    cluster.apply(tiny(job, placement=zone_a), namespace=namespace)
    for role in ("engine", "trainer", "driver"):
        running(cluster, namespace, job, role, 1)
    try:
        wait_status(
            cluster, namespace, "weightchannel", f"{job}-weights", lambda s: s.get("transport"), "transport",
            timeout=2 * WAIT,
        )  # fmt: skip
    except TimeoutError as err:
        raise AssertionError(f"no transport: {channel_story(cluster, namespace, job)}") from err
    kinds = ("rljob", "rolloutpool", "trainergroup", "weightchannel")

    def versions() -> list[str]:
        listed = cluster.get(",".join(kinds), "-n", namespace)["items"]
        return sorted(f"{o['kind']}/{o['metadata']['resourceVersion']}" for o in listed)

    def settled() -> bool:  # the operator's own passes (pods Running, readiness gates) are done
        before = versions()
        time.sleep(2)
        return versions() == before

    cluster.wait_for(settled, timeout=WAIT, what="the job and its children unchanged for 2 s")
    keys: list[Key] = [
        ("RLJob", namespace, job),
        ("RolloutPool", namespace, f"{job}-rollout"),
        ("TrainerGroup", namespace, f"{job}-trainer"),
        ("WeightChannel", namespace, f"{job}-weights"),
    ]

    import lockstep_operator.handlers as handlers

    async def two_passes() -> list[list[tuple[str, str]]]:
        async with CountingClient(await load_credentials(str(cluster.kubeconfig))) as kube:
            run = dispatch(kube, handlers.SETTINGS, sink=None)  # the running operator's settings
            writes = []
            for _ in range(2):
                kube.sent.clear()
                for key in keys:
                    await run(key)
                writes.append([(m, p) for m, p in kube.sent if m != "GET"])
            return writes

    first, second = asyncio.run(two_passes())
    assert first, "the first pass of a fresh client applies its children (no-ops on the server)"
    assert second == [], f"a pass with nothing changed wrote {second}"
