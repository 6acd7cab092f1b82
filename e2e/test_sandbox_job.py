"""The sandbox example as an RLJob on the real node: `kubectl apply` of examples/tiny-sandbox.yaml (fewer
steps) trains to Succeeded with every episode in a sandbox pod claimed from the job's warm pool; the
sandbox pods are the warm pool plus those of running episodes; deleting the job leaves no
SandboxTemplate, SandboxWarmPool, SandboxClaim, Sandbox or sandbox pod. (A released claim's pod goes
a little after its claim, by garbage collection, so the bound while running is on claims.) The operator runs in-process
(as in e2e/test_realpods.py) with the runtime image built here; agent-sandbox's controller runs next to
the control plane (docs/sandbox.md, "In a cluster")."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from lockstep.sandbox.cluster import SANDBOX_OF_LABEL

from e2e.controlplane.cluster import ControlPlane
from e2e.controlplane.realnode import REAL_NODE_LABEL
from e2e.test_realpods import operator, runtime_image  # noqa: F401  (module fixtures, reused)
from e2e.test_sandbox_cluster import sandbox_cluster  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-sandbox.yaml"
WARM, MOST = 2, 4


def _job(cluster: ControlPlane, name: str) -> dict[str, Any]:
    assert cluster.node is not None
    job: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    job["metadata"]["name"] = name
    spec = job["spec"]
    spec["algorithm"].update(
        batchSize=2, samplesPerPrompt=2, sftWarmStart={"steps": 2, "learningRate": 3.0e-3}
    )
    spec["schedule"]["steps"] = 3
    spec["schedule"].pop("evalInterval")  # its held-out episodes would claim ~64 more sandboxes here
    spec["agent"]["sandbox"].update(image=cluster.node.images["busybox"], warmPool=WARM, maxSandboxes=MOST)
    spec["placement"] = {
        "nodeSelector": {REAL_NODE_LABEL: "real"},
        "tolerations": [{"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
    }
    return job


def _names(cluster: ControlPlane, ns: str, kind: str, selector: str = "") -> list[str]:
    args = ["-n", ns, *(["-l", selector] if selector else [])]
    return sorted(i["metadata"]["name"] for i in cluster.get(kind, *args)["items"])


def test_a_sandbox_job_reaches_succeeded_and_delete_leaves_nothing(
    sandbox_cluster: ControlPlane,  # noqa: F811
    real_namespace: str,
    operator: Any,  # noqa: F811
) -> None:
    cluster, ns, name = sandbox_cluster, real_namespace, "boxjob"
    cluster.apply(_job(cluster, name), namespace=ns)
    most, stop = [0], threading.Event()

    def count() -> None:  # claims held at once by one driver pod while the job runs
        while not stop.is_set():
            live = cluster.get("sandboxclaims", "-n", ns)["items"]
            owners = Counter(
                (c["metadata"].get("ownerReferences") or [{}])[0].get("uid")
                for c in live
                if not c["metadata"].get("deletionTimestamp")
            )
            most[0] = max([most[0], *owners.values()])
            time.sleep(0.5)

    counter = threading.Thread(target=count, daemon=True)
    counter.start()
    try:
        done = cluster.wait_for(
            lambda: (
                (cluster.get("rljob", name, "-n", ns).get("status") or {}).get("phase")
                in ("Succeeded", "Failed")
                or None
            ),
            timeout=1500,
            what=f"rljob {name} finished",
        )
    finally:
        stop.set()
        counter.join(5)
    status = cluster.get("rljob", name, "-n", ns)["status"]
    assert status["phase"] == "Succeeded", (
        done,
        status,
        cluster.kubectl("logs", f"{name}-driver", "-n", ns, check=False).stdout[-3000:],
    )
    assert status["step"] == 3
    # Episodes claimed sandboxes (the bound on claims held at once is the provider's, checked exactly in
    # e2e/test_sandbox_cluster.py: a list taken here every 0.5 s saw up to maxSandboxes + 1, a release and
    # the next claim racing the list).
    assert most[0] > 0, most
    cluster.wait_for(
        lambda: not _names(cluster, ns, "sandboxclaims") or None, timeout=120, what="no claim after the run"
    )
    # Episodes over: the sandbox pods left are the warm pool's (released ones are collected).
    cluster.wait_for(
        lambda: len(_names(cluster, ns, "pods", f"{SANDBOX_OF_LABEL}={name}")) == WARM or None,
        timeout=300,
        what=f"only the warm pool's {WARM} sandbox pods",
    )
    cluster.kubectl("delete", "rljob", name, "-n", ns, "--wait=false")
    for kind in ("sandboxtemplates", "sandboxwarmpools", "sandboxclaims", "sandboxes"):
        cluster.wait_for(
            lambda kind=kind: not _names(cluster, ns, kind) or None, timeout=300, what=f"no {kind}"
        )
    cluster.wait_for(
        lambda: not _names(cluster, ns, "pods", f"{SANDBOX_OF_LABEL}={name}") or None,
        timeout=300,
        what="no sandbox pod",
    )
