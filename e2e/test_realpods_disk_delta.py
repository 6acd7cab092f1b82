"""disk-delta per host on real pods: examples/tiny-disk-delta.yaml (`transport: disk-delta`, two engine
pods) from `kubectl apply` to Succeeded on the local cluster's real node.

The operator renders each engine pod with its `delta-agent` sidecar and an emptyDir for its own copy
(resources.delta_agent); trainer rank 0 publishes on the shared volume: the whole checkpoint once as
the base, only deltas after (lockstep.weights.disk_delta_shared); every agent patches its own copy and
reloads its engine (lockstep.weights.delta_agent). Checked from the shared volume's host directory:
one base, one delta per version and no engine copy written by the trainer; each agent (named by its
pod) at the last version, holding exactly the checksums the trainer published, having applied that
version itself from its own earlier copy; and from the driver's metrics, the bytes the trainer wrote:
one full copy at version 0, then per step less than one full copy (against the full copy per engine
per step a trainer-side patch or a full reload would move). A corrupted delta refused by the agents
without a reload is runtime/tests/weights/test_disk_delta_agents.py (the same agent code, two
engines, real HTTP). A driver that crash-loops fails the test at once with the pods' story (e.g. every
agent refusing version 0), instead of at RUN_TIMEOUT.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.controlplane.cluster import ControlPlane
from e2e.operator_runner import InClusterOperator
from e2e.test_realpods import (
    RUN_TIMEOUT,
    JobEnded,
    fail_with,
    job_status,
    operator,
    pods,
    poll,
    runtime_image,
    shared_volume,
    wait,
)

__all__ = ["operator", "runtime_image"]  # the fixtures, shared with the example's e2e test

pytestmark = pytest.mark.timeout(3600)  # cold: the images are built and imported first

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny-disk-delta.yaml"
STEPS = 4
"""RL steps (the example has 20): version 0 (the base) and four deltas."""
SFT_STEPS = 2
"""SFT warm-start steps (the example has 20): what is checked does not depend on the policy's start."""
CRASH_LOOP = 3
"""Driver restarts that fail the test at once: no fault is injected here, so a driver that keeps
failing (an update some agent refuses) would only end at RUN_TIMEOUT."""


def finished(cluster: ControlPlane, ns: str, job: str) -> dict[str, Any]:
    """The job's status once Succeeded or Failed; fails at once, with the pods' story, when the driver
    crash-loops."""

    def done() -> dict[str, Any] | None:
        st = job_status(cluster, ns, job)
        if st.get("phase") in ("Succeeded", "Failed"):
            return st
        driver = cluster.get("pod", f"{job}-driver", "-n", ns)["status"].get("containerStatuses") or [{}]
        if (restarts := int(driver[0].get("restartCount", 0))) >= CRASH_LOOP:
            raise JobEnded(fail_with(cluster, ns, f"the driver restarted {restarts} times; status {st}"))
        return None

    st: dict[str, Any] = poll(cluster, ns, done, f"rljob {job} finished", RUN_TIMEOUT)
    return st


def test_a_disk_delta_job_patches_each_engines_own_copy(
    real_cluster: ControlPlane, real_namespace: str, operator: InClusterOperator
) -> None:
    cluster, ns = real_cluster, real_namespace
    manifest: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    job = manifest["metadata"]["name"]
    spec = manifest["spec"]
    assert spec["weightSync"]["transport"] == "disk-delta" and spec["rollout"]["replicas"] == 2, spec
    spec["schedule"]["steps"] = STEPS
    spec["algorithm"]["sftWarmStart"]["steps"] = SFT_STEPS
    host = shared_volume(cluster, ns, spec["weightSync"]["diskDelta"]["volumeClaim"])
    cluster.apply(manifest, namespace=ns)
    wait(cluster, ns, lambda: len(pods(cluster, ns, job, "engine")) == 2, "two engine pods", timeout=600)
    engines = sorted(p["metadata"]["name"] for p in pods(cluster, ns, job, "engine"))
    for pod in pods(cluster, ns, job, "engine"):  # each engine pod runs its agent beside it, own volume
        names = [c["name"] for c in pod["spec"]["containers"]]
        assert names == ["main", "delta-agent"], names
        assert {"name": "delta-local", "emptyDir": {}} in pod["spec"]["volumes"]
    st = finished(cluster, ns, job)
    assert st["phase"] == "Succeeded", fail_with(cluster, ns, f"status {st}")
    assert st["step"] == STEPS and st["weightVersion"] == STEPS and st["transport"] == "disk-delta", st

    run_dir = host / "lockstep" / job
    root = run_dir / "trainer" / "delta"  # rank 0's publish root, the agents' --root
    listing = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    assert root.is_dir(), listing
    base = sorted(p.name for p in (root / "base").iterdir() if p.is_dir())
    assert base == ["weight_v000000"], base  # the whole checkpoint, written once
    deltas = sorted(p.name for p in root.glob("weight_v*"))
    assert deltas == [f"weight_v{v:06d}" for v in range(1, STEPS + 1)], deltas
    # the trainer patched no copy itself (the one-machine variant keeps them in engine-copies/)
    assert not any("engine-copies" in p for p in listing), listing

    last = json.loads((root / f"weight_v{STEPS:06d}" / "model.safetensors.index.json").read_text())
    trainer = {n: s["checksum"] for n, s in last["state"].items()}
    assert trainer, last
    agents = {p.stem: json.loads(p.read_text()) for p in (root / "agents").glob("*.json")}
    assert sorted(agents) == engines, (sorted(agents), engines)  # one agent per engine pod, by its name
    for name, state in agents.items():  # each engine's own copy: patched by its agent to the trainer's
        assert state["error"] is None and state["version"] == STEPS, (name, state)
        assert state["applied"] == [STEPS] and not state["copied_base"], (name, state)  # from its own copy
        assert state["read_bytes"] > 0 and state["checksums"] == trainer, name

    # The bytes the trainer wrote: the base at version 0, then per step less than one full copy.
    rows = [json.loads(line) for line in (run_dir / "driver" / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "update_weights_full_copy_bytes" in r]
    assert [r["step"] for r in updates] == list(range(STEPS + 1)), [(r["kind"], r["step"]) for r in updates]
    full = updates[0]["update_weights_full_copy_bytes"]
    wire = [r["update_weights_wire_bytes"] for r in updates]
    assert wire[0] >= full, (wire, full)  # version 0: the one full copy (and the config files)
    assert all(0 < w < full for w in wire[1:]), (wire, full)
    for version, w in enumerate(wire[1:], start=1):  # what the driver reports is what the index says
        index = json.loads((root / f"weight_v{version:06d}" / "model.safetensors.index.json").read_text())
        assert index["metrics"]["update_weights_wire_bytes"] == w, (version, index["metrics"], w)
    density = [r["update_weights_density"] for r in updates]
    print(json.dumps({"full_copy_bytes": full, "engines": len(engines), "wire_bytes": wire,
                      "density": density, "full_copy_per_engine_bytes": full * len(engines) * len(wire)}))  # fmt: skip
