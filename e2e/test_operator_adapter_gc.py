"""End-to-end (kwok): a deleted job's adapter leaves the shared pool it trained on.

Against the real control plane with the operator in-process (see test_operator_reconcile). kwok pods run
no process, so the test plays the unload pod's end. Checked: a standalone pool remembers the adapter of
the job that samples on it (annotation rl.lockstep.dev/adapters); deleting the job makes the operator
create one unload pod that runs `lockstep unload-adapter <job> --engine <each serving engine>`, carries
the pool-client label the pool's NetworkPolicy admits and the pool's key; once it Succeeded the pod is
deleted and the name forgotten; the pool and its engines stay. A job created again under the deleted
job's name waits until that job's unload pod is gone (it would unload the new job's versions too). The
real unload is checked against the
reference engine (runtime/tests/engine/test_unload_adapter.py) and on the real node
(e2e/test_realpods_lora.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from e2e.controlplane.cluster import ControlPlane
from e2e.operator_runner import Operator
from e2e.test_operator_reconcile import WAIT, cond, operator, pods, running, status

__all__ = ["operator"]

ROOT = Path(__file__).resolve().parent.parent
POOL = "shared-tiny"
ADAPTERS = "rl.lockstep.dev/adapters"


def _docs() -> tuple[dict[str, Any], dict[str, Any]]:
    """The example's pool and job reverse-a, without the real node's placement."""
    docs = list(
        yaml.safe_load_all((ROOT / "examples" / "local-cluster" / "lora-shared-pool.yaml").read_text())
    )
    pool = next(d for d in docs if d["kind"] == "RolloutPool")
    job = next(d for d in docs if d["kind"] == "RLJob" and d["metadata"]["name"] == "reverse-a")
    pool["spec"].pop("placement", None)
    job["spec"].pop("placement", None)
    job["spec"]["placement"] = {"gang": {"scheduler": "none"}}
    return pool, job


def _remembered(cluster: ControlPlane, ns: str) -> list[str] | None:
    ann = cluster.get("rolloutpool", POOL, "-n", ns)["metadata"].get("annotations") or {}
    return json.loads(ann[ADAPTERS]) if ADAPTERS in ann else None


def test_a_deleted_jobs_adapter_is_unloaded_from_the_shared_pools_engines(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    ns = namespace
    pool, job = _docs()
    cluster.apply([pool, job], namespace=ns)
    engine = running(cluster, ns, POOL, "engine", 1)[0]
    cluster.wait_for(
        lambda: _remembered(cluster, ns) == ["reverse-a"], timeout=WAIT, what="the pool remembers reverse-a"
    )
    assert not pods(cluster, ns, POOL, "adapter-gc")  # a live job's adapter never leaves
    cluster.kubectl("delete", "rljob", "reverse-a", "-n", ns, "--wait=false")

    def unload() -> dict[str, Any] | None:
        found = pods(cluster, ns, POOL, "adapter-gc")
        return found[0] if found else None

    pod = cluster.wait_for(unload, timeout=WAIT, what="the unload pod of reverse-a")
    assert pod is not None
    main = pod["spec"]["containers"][0]
    ip = (
        engine["status"]["podIP"]
        if engine["status"].get("podIP")
        else running(cluster, ns, POOL, "engine", 1)[0]["status"]["podIP"]
    )
    assert main["command"] == ["lockstep", "unload-adapter", "reverse-a", "--engine", f"http://{ip}:30000"], (
        main
    )
    assert pod["metadata"]["labels"]["rl.lockstep.dev/pool-client"] == POOL
    assert main["env"][0]["valueFrom"]["secretKeyRef"]["name"] == f"{POOL}-api-key"
    assert _remembered(cluster, ns) == ["reverse-a"]  # until the unload succeeded
    # kwok runs no process: the test ends the pod as `lockstep unload-adapter` would (exit 0)
    status = {"status": {"phase": "Succeeded"}}
    cluster.kubectl(
        "patch", "pod", pod["metadata"]["name"], "-n", ns, "--subresource=status", "--type=merge", "-p", json.dumps(status)
    )  # fmt: skip
    cluster.wait_for(
        lambda: not pods(cluster, ns, POOL, "adapter-gc") and _remembered(cluster, ns) == [],
        timeout=WAIT,
        what="the unload pod deleted and reverse-a forgotten",
    )
    assert len(running(cluster, ns, POOL, "engine", 1)) == 1  # the pool and its engine stay


HOLD = "e2e.lockstep.dev/hold"


def test_a_job_created_again_under_its_name_waits_until_the_unload_pod_is_gone(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    """reverse-a deleted, its unload pod created; the user creates reverse-a again at once. The pod
    unloads every reverse-a-v<N> it finds on the engines, so versions the new job loaded while it still
    ran would go too: the new job waits (Admitted=False naming the pod) and starts nothing until the pod
    is gone; the pool deletes the pod as soon as a live job uses the name. A finalizer holds the deleted
    pod here, as a process running out its grace period would (docs/lora.md, "Cleanup")."""
    ns = namespace
    pool, job = _docs()
    cluster.apply([pool, job], namespace=ns)
    running(cluster, ns, "reverse-a", "driver", 1)
    cluster.wait_for(
        lambda: _remembered(cluster, ns) == ["reverse-a"], timeout=WAIT, what="the pool remembers reverse-a"
    )
    cluster.kubectl("delete", "rljob", "reverse-a", "-n", ns, "--wait=false")
    found = cluster.wait_for(
        lambda: pods(cluster, ns, POOL, "adapter-gc"), timeout=WAIT, what="the unload pod of reverse-a"
    )
    unload = found[0]["metadata"]["name"]
    hold = {"metadata": {"finalizers": [HOLD]}}
    cluster.kubectl("patch", "pod", unload, "-n", ns, "--type=merge", "-p", json.dumps(hold))
    cluster.wait_for(
        lambda: not cluster.get("rljobs", "-n", ns)["items"] and not pods(cluster, ns, "reverse-a"),
        timeout=WAIT,
        what="the first reverse-a and its pods gone",
    )
    cluster.apply(job, namespace=ns)  # created again under its name

    def admitted() -> dict[str, Any]:
        return cond(status(cluster, ns, "rljob", "reverse-a"), "Admitted")

    verdict = cluster.wait_for(admitted, timeout=WAIT, what="the new reverse-a's Admitted condition")
    assert verdict["status"] == "False" and verdict["reason"] == "AdapterUnloading", verdict
    assert f"pod {unload} still unloads" in verdict["message"], verdict
    # the pool deletes the pod (its name is used again); the finalizer keeps it terminating
    cluster.wait_for(
        lambda: pods(cluster, ns, POOL, "adapter-gc")[0]["metadata"].get("deletionTimestamp"),
        timeout=WAIT,
        what="the unload pod deleted by the pool",
    )
    assert not pods(cluster, ns, "reverse-a"), "the new job started while the unload pod was still there"
    cluster.kubectl("patch", "pod", unload, "-n", ns, "--type=json", "-p", '[{"op":"remove","path":"/metadata/finalizers"}]')  # fmt: skip
    running(cluster, ns, "reverse-a", "driver", 1)
    assert admitted()["status"] == "True"
