"""Multi-LoRA on real pods: two RLJobs train their own adapters on one standalone RolloutPool.

`kubectl apply` of examples/local-cluster/lora-shared-pool.yaml (shortened) on the local cluster's real
node: the user's pool (spec.job unset) runs reference engines with --enable-lora; each job runs its
driver and trainer rank against it (rollout.poolRef). Checked: two jobs finish Succeeded while the
pool scales from one engine to two (the node runs one driver at a time: the jobs are applied in
turn) (the joined engine holds none of their adapters: its readiness
gate keeps it out of the router until each job's next update has loaded one there, so no request
names a version it lacks); a third job, deleted mid-run, leaves the pool, its engines and the other
jobs untouched, and its trainer unloads its adapters on the way out; a version of its adapter its
trainer never loaded (what a run killed before its close leaves: loaded here by hand) is unloaded by
the operator once the job is gone (an unload pod of the pool: docs/lora.md, "Cleanup"); the engines
themselves (GET /engine_stats) say which adapters sampled tokens, and none are left loaded at the end.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.controlplane.cluster import ControlPlane
from e2e.operator_runner import Operator
from e2e.test_realpods import diagnose, finished, job_status, operator, pods, runtime_image, wait

__all__ = ["operator", "runtime_image"]  # the fixtures, shared with the example's e2e test

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "local-cluster" / "lora-shared-pool.yaml"
POOL = "shared-tiny"

pytestmark = pytest.mark.timeout(3600)


def _docs(steps: dict[str, int]) -> list[dict[str, Any]]:
    """The example, each job's steps set, plus reverse-c: reverse-a under another name (the job that
    is deleted mid-run)."""
    docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
    a = next(d for d in docs if d["kind"] == "RLJob" and d["metadata"]["name"] == "reverse-a")
    c = copy.deepcopy(a)
    c["metadata"]["name"] = "reverse-c"
    docs.append(c)
    for d in docs:
        if d["kind"] == "RLJob":
            d["spec"]["schedule"]["steps"] = steps[d["metadata"]["name"]]
            d["spec"]["algorithm"]["sftWarmStart"]["steps"] = 4
    return docs


def _engine_stats(cluster: ControlPlane, ns: str, engine: dict[str, Any]) -> dict[str, Any]:
    """GET /engine_stats of one engine of the pool, asked inside its pod (it binds the pod IP only)."""
    code = (
        "import json, os, urllib.request; "
        "print(urllib.request.urlopen(f\"http://{os.environ['POD_IP']}:30000/engine_stats\").read().decode())"
    )
    out = cluster.kubectl("exec", "-n", ns, engine["metadata"]["name"], "--", "python3", "-c", code).stdout
    stats: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return stats


LEFTOVER = "reverse-c-v999"
_LOAD_LEFTOVER = f"""
import asyncio, os, torch
from lockstep.serving import EngineClient
from lockstep.serving.lora import adapter_config
from lockstep.serving.tensor_codec import dumps_tensors_by_value
p = "base_model.model.model.layers.0.self_attn.q_proj."
t = {{p + "lora_A.weight": torch.zeros(4, 64), p + "lora_B.weight": torch.zeros(64, 4)}}
cfg = adapter_config({{k: v.shape for k, v in t.items()}}, alpha=8)
async def go():
    async with EngineClient(f"http://{{os.environ['POD_IP']}}:30000", retries=1) as c:
        await c.load_lora_adapter_from_tensors("{LEFTOVER}", cfg, dumps_tensors_by_value(t.items()))
asyncio.run(go())
"""
"""Loads an adapter version named like reverse-c's (a rank-4 q_proj adapter of builtin:tiny) on an
engine, with the engine's own key: what a reverse-c trainer killed before its close would leave."""


def _engines(cluster: ControlPlane, ns: str) -> list[dict[str, Any]]:
    running = [p for p in pods(cluster, ns, POOL, "engine") if p["status"].get("phase") == "Running"]
    return sorted(running, key=lambda p: p["metadata"]["name"])


def _holding(cluster: ControlPlane, ns: str, job: str) -> dict[str, Any] | None:
    """A running engine of the pool that holds a version of `job`'s adapter, None when none does."""
    for engine in _engines(cluster, ns):
        if any(n.startswith(f"{job}-v") for n in _engine_stats(cluster, ns, engine)["loaded_adapters"]):
            return engine
    return None


def _ready(pod: dict[str, Any]) -> bool:
    conditions = pod["status"].get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_two_jobs_share_a_pool_a_joined_engine_waits_for_their_adapters_and_a_deleted_job_leaves(
    real_cluster: ControlPlane, real_namespace: str, operator: Operator
) -> None:
    cluster, ns = real_cluster, real_namespace
    docs = _docs({"reverse-a": 12, "reverse-b": 6, "reverse-c": 60})
    by_name = {d["metadata"]["name"]: d for d in docs}
    # a driver requests 1 CPU of the node's 2, beside the operator and CoreDNS: one runs at a time and the
    # others wait Pending. Each job is applied once the one before it runs, so the order is the test's,
    # not the scheduler's (reverse-c scheduled first ran its 60 steps before reverse-a began)
    cluster.apply(
        [d for d in docs if d["kind"] != "RLJob" or d["metadata"]["name"] == "reverse-a"], namespace=ns
    )

    def step(job: str) -> int:
        return int(job_status(cluster, ns, job).get("step") or 0)

    # once reverse-a has published adapter versions, the pool scales up: the joined engine holds none
    # of them and must stay out of the router until each job's next update has loaded one there
    wait(cluster, ns, lambda: step("reverse-a") >= 1, "reverse-a at step 1")
    cluster.kubectl("scale", "rolloutpool", POOL, "-n", ns, "--replicas=2")
    cluster.apply([by_name["reverse-c"]], namespace=ns)
    # reverse-c runs long; once it has published a few adapter versions it is deleted
    wait(cluster, ns, lambda: step("reverse-c") >= 2, "reverse-c at step 2")
    # an engine reverse-c's trainer already reached: on the first reach a trainer unloads the versions
    # of its adapter it did not load itself (docs/lora.md), which would take the leftover too early
    holder = wait(cluster, ns, lambda: _holding(cluster, ns, "reverse-c"), "an engine holding reverse-c")
    cluster.kubectl("exec", "-n", ns, holder["metadata"]["name"], "--", "python3", "-c", _LOAD_LEFTOVER)
    assert LEFTOVER in _engine_stats(cluster, ns, holder)["loaded_adapters"]
    cluster.kubectl("delete", "rljob", "reverse-c", "-n", ns, "--wait=true", "--timeout=600s")

    def left_gone() -> bool:  # its trainer never loaded it: only the operator's cleanup unloads it
        return not any(
            n.startswith("reverse-c-") for n in _engine_stats(cluster, ns, holder)["loaded_adapters"]
        )

    cluster.apply([by_name["reverse-b"]], namespace=ns)
    wait(cluster, ns, left_gone, "reverse-c's leftover version unloaded by the operator", timeout=300)
    for job, steps in (("reverse-a", 12), ("reverse-b", 6)):  # neither the join nor the deletion touched them
        st = finished(cluster, ns, job)
        assert st["phase"] == "Succeeded" and st["step"] == steps, (job, st, diagnose(cluster, ns))
    # the pool is the user's: it and its engines outlive every job
    pool = cluster.get("rolloutpool", POOL, "-n", ns)
    assert pool["spec"].get("job") is None

    def both() -> list[dict[str, Any]] | None:
        running = _engines(cluster, ns)
        return running if len(running) == 2 else None

    engines = wait(cluster, ns, both, "both engines")

    def settled() -> list[dict[str, Any]] | None:
        stats = [_engine_stats(cluster, ns, e) for e in engines]
        return stats if not any(s["loaded_adapters"] for s in stats) else None

    first, joined = wait(cluster, ns, settled, "every job's adapters unloaded", timeout=300)
    tokens: dict[str, int] = first["adapter_tokens"]
    assert {n.rsplit("-v", 1)[0] for n in tokens} == {"reverse-a", "reverse-b", "reverse-c"}, tokens
    assert all(v > 0 for v in tokens.values()), tokens
    # the joined engine sampled the jobs' requests, each with a version loaded there first (a request
    # naming a version it lacked would have failed its job), and never reverse-c's deleted ones late
    late: dict[str, int] = joined["adapter_tokens"]
    assert late and {n.rsplit("-v", 1)[0] for n in late} <= {"reverse-a", "reverse-b", "reverse-c"}, late
    a_late = [n for n in late if n.startswith("reverse-a-")]  # b and c may have started after the join
    assert all(int(n.rsplit("-v", 1)[1]) >= 2 for n in a_late), late  # it joined after a's version 1
    assert all(_ready(e) for e in _engines(cluster, ns)), diagnose(cluster, ns)
