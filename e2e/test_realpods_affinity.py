"""Session affinity on the real node, read from the engines: the sandbox example as an RLJob whose pool
runs two engine pods, episodes of up to three turns, trains to Succeeded; every turn of each session
hit one engine, and both engines served multi-turn sessions (docs/tito.md, "Affinity").

Why: e2e/test_session_routing.py proves the routing with local engines and EndpointSlices the test
writes; here the EndpointSlices are the ones Kubernetes' controller writes from the engine pods'
readiness, the session server is the driver pod's, the turns are the terminal agent's. Which engine
served a session's turns is each engine's own count per session key (GET /engine_stats'
`session_turns`: the X-SMG-Routing-Key header of every turn), asked inside the engine pods while the
job runs (a finished job's engines are deleted): a session whose turns were scattered shows its key on
both engines. The warm start (200 SFT steps) makes most replies a tool call, so most episodes take
more than one turn.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from e2e.controlplane.cluster import ControlPlane
from e2e.test_realpods import diagnose, job_status, live, operator, pods, runtime_image, wait
from e2e.test_realpods_lora import _engine_stats
from e2e.test_sandbox_cluster import sandbox_cluster
from e2e.test_sandbox_job import _job

__all__ = ["operator", "runtime_image", "sandbox_cluster"]  # module fixtures, reused

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]
JOB = "affinity"


def owners(turns: dict[str, dict[str, int]]) -> dict[str, str]:
    """Session key -> the one engine that served its turns, from each engine's `session_turns` (engine
    name -> key -> turns); fails naming the sessions whose turns hit several engines."""
    seen: dict[str, list[str]] = {}
    for engine, keys in turns.items():
        for key in keys:
            seen.setdefault(key, []).append(engine)
    scattered = {k: {e: turns[e][k] for e in es} for k, es in seen.items() if len(es) > 1}
    assert not scattered, f"sessions whose turns hit several engines: {scattered}"
    return {k: es[0] for k, es in seen.items()}


def test_each_sessions_turns_hit_one_engine_pod(
    sandbox_cluster: ControlPlane,
    real_namespace: str,
    operator: Any,
) -> None:
    cluster, ns = sandbox_cluster, real_namespace
    job = _job(cluster, JOB)
    spec = job["spec"]
    spec["rollout"]["replicas"] = 2
    # 16 episodes of up to 3 turns; 16 SFT rows a step teach the tool call (a call's result asks for a turn)
    spec["algorithm"].update(
        batchSize=4, samplesPerPrompt=4, sftWarmStart={"steps": 200, "learningRate": 3.0e-3}
    )
    spec["agent"]["maxTurns"] = 3
    # The example samples at 1.8, where most tool calls break and a broken call ends its episode after
    # one turn; at 1 the warm start's calls come out whole and ask for more turns.
    spec["rollout"]["sampling"]["temperature"] = 1.0
    spec["schedule"]["steps"] = 1
    cluster.apply(job, namespace=ns)
    turns: dict[str, dict[str, int]] = {}  # engine pod -> its latest session_turns

    def read_engines() -> dict[str, Any] | None:
        for engine in live(pods(cluster, ns, JOB, "engine")):
            if engine["status"].get("phase") == "Running":
                # not serving yet, or going: its last reading stands
                with contextlib.suppress(Exception):
                    turns[engine["metadata"]["name"]] = _engine_stats(cluster, ns, engine)["session_turns"]
        st = job_status(cluster, ns, JOB)
        return st if st.get("phase") in ("Succeeded", "Failed") else None

    status = wait(cluster, ns, read_engines, f"rljob {JOB} finished")
    assert status["phase"] == "Succeeded" and status["step"] == 1, (status, diagnose(cluster, ns))
    assert len(turns) == 2, turns  # the pool's two engines (neither was replaced)
    owner = owners(turns)
    multi = {owner[k] for e in turns.values() for k, n in e.items() if n > 1}
    for engine, keys in sorted(turns.items()):  # shown with -rP: sessions and turns per engine
        print(f"{engine}: {len(keys)} sessions, turns {sorted(keys.values())}")
    assert multi == set(turns), (f"both engines served multi-turn sessions: {turns}", diagnose(cluster, ns))
