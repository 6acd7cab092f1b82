# ruff: noqa: F811  (test_realpods' fixtures are imported by name and used as parameters)
"""Nothing lost, nothing silent, on real pods: the example job on the local cluster's real node.

- A job whose agent raises on every trajectory ends `Failed` with reason `RolloutFailed` and the
  agent's error in the message (it used to Succeed having trained nothing). The agent is user code in
  the job's own image (spec.agent.image): the runtime image plus one module, built here.
- No pod's log holds the job's API key (the engine's, the ranks', the driver's).
- The example in fully-async mode, its driver pod force-deleted mid-run (SIGKILL, no grace) and then
  trainer rank 0 deleted (SIGTERM: it checkpoints the steps trained since the last save, then the gang
  restarts from that checkpoint): the job Succeeds with exactly its steps, and every prompt it drew was
  trained exactly once or is still pending (none skipped, none twice), from the driver's metrics.jsonl
  and the last checkpoint on the shared volume.

Helpers and fixtures are test_realpods.py's (the operator as users run it, the shared hostPath volume).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from lockstep.observability.metrics import read_jsonl
from lockstep.trainer.state import latest_checkpoint

from e2e.controlplane.cluster import ControlPlane
from e2e.operator_runner import Operator
from e2e.test_realpods import (  # noqa: F401  (operator and runtime_image are fixtures)
    example,
    fail_with,
    finished,
    job_status,
    live,
    operator,
    pods,
    poll,
    runtime_image,
    shared_volume,
)

pytestmark = [pytest.mark.e2e, pytest.mark.heavy, pytest.mark.timeout(3600)]

AGENT_MODULE = "lockstep_e2e_agent"
AGENT_SOURCE = '''"""A user agent that fails every episode (its sandbox never starts)."""


async def always_fails(ctx, sample):
    raise RuntimeError("the sandbox refused to start: no shell in the image")
'''


@pytest.fixture(scope="module")
def agent_image(real_cluster: ControlPlane, runtime_image: str) -> str:
    """The runtime image plus the user's agent module: what a user builds FROM the runtime image."""
    from e2e.controlplane.node.images import Entry, build_archive
    from e2e.controlplane.node.runtime_image import PREFIX, PY, RECIPES, image_spec, install

    assert real_cluster.node is not None
    node = real_cluster.node
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "pkg"
        install("package", RECIPES["runtime"], "amd64", root)
        base = image_spec(RECIPES["runtime"], "amd64", root)
        site = f"{PREFIX}/lib/{PY}/site-packages"
        module = Entry(f"{site}/{AGENT_MODULE}.py", data=AGENT_SOURCE.encode(), mode=0o644)
        spec = dataclasses.replace(base, name="e2e-agent", entries=[*base.entries, module])
        have = frozenset(node.ctr("content", "list", "--quiet").stdout.split())
        ref, archive = build_archive(spec, Path(tmp) / "out", omit=have)
        node.import_image(ref, archive)
    return ref


def _key(cluster: ControlPlane, ns: str, job: str) -> str:
    secret = cluster.get("secret", f"{job}-api-key", "-n", ns)
    return base64.b64decode(secret["data"]["api-key"]).decode()


def _driver_story(cluster: ControlPlane, ns: str, job: str) -> str:
    """The driver's log lines that tell what happened to groups (both containers of the pod)."""
    words = ("resum", "trajector", "abort", "SIGTERM", "pending", "drop", "restart", "checkpoint")
    lines = []
    for extra in (("--previous",), ()):
        out = cluster.kubectl("logs", "-n", ns, f"{job}-driver", *extra, check=False).stdout
        lines += [ln for ln in out.splitlines() if any(w in ln for w in words)]
    return "\n".join(lines[-80:])


def _logs_without(cluster: ControlPlane, ns: str, job: str, key: str) -> None:
    """No container of the job's pods (previous containers included) logged the key."""
    for pod in pods(cluster, ns, job):
        name = pod["metadata"]["name"]
        for extra in ((), ("--previous",)):
            out = cluster.kubectl("logs", "-n", ns, name, "--all-containers", *extra, check=False).stdout
            assert key not in out, f"{name} logged the job's API key"


def test_a_job_whose_every_trajectory_fails_ends_failed_with_the_error(
    real_cluster: ControlPlane, real_namespace: str, operator: Operator, agent_image: str
) -> None:
    cluster, ns, job = real_cluster, real_namespace, "tiny-fails"
    manifest = example(job, agent={"image": agent_image, "agentFunction": f"{AGENT_MODULE}:always_fails"})
    manifest["spec"]["algorithm"].pop("sftWarmStart", None)
    shared_volume(cluster, ns, f"{job}-shared")
    cluster.apply(manifest, namespace=ns)
    st = finished(cluster, ns, job)
    assert st["phase"] == "Failed", fail_with(cluster, ns, f"status: {st}")
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "RolloutFailed", failed
    assert (
        "all" in failed["message"]
        and "the sandbox refused to start: no shell in the image" in failed["message"]
    )
    _logs_without(cluster, ns, job, _key(cluster, ns, job))


STEPS = 16


def test_driver_force_deleted_and_a_drained_rank_lose_no_prompt(
    real_cluster: ControlPlane, real_namespace: str, operator: Operator
) -> None:
    cluster, ns, job = real_cluster, real_namespace, "tiny-lossless"
    manifest = example(job)
    spec = manifest["spec"]
    spec["algorithm"].pop("sftWarmStart", None)
    spec["schedule"] = {
        **spec["schedule"],
        "mode": "fully-async",
        "colocate": False,
        "steps": STEPS,
        "saveInterval": 4,
    }
    spec["schedule"].pop("maxWeightStaleness", None)
    spec["weightSync"]["pauseMode"] = "retract"
    host = shared_volume(cluster, ns, f"{job}-shared")
    cluster.apply(manifest, namespace=ns)

    def step_at_least(n: int) -> Any:
        st = job_status(cluster, ns, job)
        if st.get("phase") in ("Succeeded", "Failed"):
            raise AssertionError(fail_with(cluster, ns, f"the job ended early: {st}"))
        return st.get("phase") == "Running" and (st.get("step") or 0) >= n and st

    poll(cluster, ns, lambda: step_at_least(5), "step 5", timeout=1500)
    [driver] = live(pods(cluster, ns, job, "driver"))
    cluster.kubectl("delete", "pod", driver["metadata"]["name"], "-n", ns, "--grace-period=0", "--force")
    poll(cluster, ns, lambda: step_at_least(10), "step 10 after the driver's restart", timeout=1500)
    rank0 = next(p for p in live(pods(cluster, ns, job, "trainer")) if p["metadata"]["name"].endswith("-0"))
    cluster.kubectl("delete", "pod", rank0["metadata"]["name"], "-n", ns, "--wait=false")  # SIGTERM
    st = finished(cluster, ns, job)
    assert st["phase"] == "Succeeded" and st["step"] == STEPS, fail_with(cluster, ns, f"status: {st}")
    run = host / "lockstep" / job
    metrics = run / "driver" / "metrics.jsonl"
    data = read_jsonl(metrics, "data")
    assert [r["step"] for r in data] == list(range(1, STEPS + 1)), data
    trained = Counter(p for r in data for p in r["positions"])
    assert max(trained.values()) == 1, [p for p, n in trained.items() if n > 1]
    checkpoint = latest_checkpoint(run / "trainer")
    assert checkpoint is not None, sorted(str(p) for p in run.rglob("*"))[:50]
    extra = json.loads((checkpoint / "trainer_state.json").read_text())["extra"]
    pending = {p for _, p in extra.get("pending_groups", [])}
    skipped = set(range(extra["prompts_consumed"])) - set(trained) - pending
    assert skipped == set(), (
        f"drawn but never trained: {sorted(skipped)}; group counts {extra.get('group_counts')}; pending "
        f"{sorted(pending)}; the driver's log:\n{_driver_story(cluster, ns, job)}"
    )
    assert any(r["kind"] == "resume" for r in read_jsonl(metrics, raw=True))
    _logs_without(cluster, ns, job, _key(cluster, ns, job))
