"""End-to-end: the operator's Kubernetes Events and its ReconcileError condition, on the real API server.

Why: `kubectl describe rljob` is where users look first; these tests hold the operator to telling a
gang restart, a scale, a failed pre-flight and a refused child there, with stable reasons, and to
backing off (not retrying every second) while the API keeps refusing. The event sink's deduplication,
aggregation and rate limit run against the real API server (Events are real objects) on a fake clock.
kwok pods run no process: the tests play the driver through the progress ConfigMap, and fail pods
with kwok's inject-failure label, as e2e/test_operator_reconcile.py does.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from typing import Any

from lockstep_operator.k8s.client import KubeClient, load_credentials
from lockstep_operator.k8s.events import EventSink, ObjectRef
from lockstep_operator.policy.events import Reason, normal, warning

from e2e import test_operator_reconcile
from e2e.controlplane.cluster import ControlPlane
from e2e.operator_runner import Operator
from e2e.test_operator_reconcile import (
    WAIT,
    cond,
    phase_is,
    report,
    running,
    status,
    tiny,
)

operator = test_operator_reconcile.operator
"""The operator running for this module (the same fixture as e2e/test_operator_reconcile.py's)."""


def events(cluster: ControlPlane, ns: str, kind: str, name: str) -> list[dict[str, Any]]:
    """The Events about one object, oldest first (what kubectl describe lists)."""
    selector = f"involvedObject.kind={kind},involvedObject.name={name}"
    items: list[dict[str, Any]] = cluster.get("events", "-n", ns, "--field-selector", selector)["items"]
    return sorted(items, key=lambda e: e.get("lastTimestamp") or "")


def wait_event(cluster: ControlPlane, ns: str, kind: str, name: str, reason: str) -> dict[str, Any]:
    """Wait for an Event with `reason` about `kind/name`; return it."""

    def find() -> dict[str, Any] | None:
        return next((e for e in events(cluster, ns, kind, name) if e["reason"] == reason), None)

    try:
        found = cluster.wait_for(find, timeout=WAIT, what=f"event {reason} on {kind} {name}")
    except TimeoutError as err:
        seen = [(e["reason"], e["message"]) for e in events(cluster, ns, kind, name)]
        st = cluster.get(kind.lower(), name, "-n", ns).get("status")
        raise TimeoutError(f"{err}; events there: {seen}; status: {st}") from None
    assert found is not None
    return found


def test_describe_tells_the_phases_a_gang_restart_and_a_scale(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    job = "story"
    cluster.apply(tiny(job, trainer={"nodes": 2}), namespace=namespace)
    running(cluster, namespace, job, "trainer", 2)
    phase_is(cluster, namespace, job, "Preflight")
    report(cluster, namespace, job, step=0, weightVersion=0, preflight="passed")
    phase_is(cluster, namespace, job, "Running")
    # Provisioning is told only when a pass sees the pods not yet running: kwok starts them within
    # milliseconds, so the pass after Pending may already find them running and go on to Preflight.
    for reason in ("Pending", "Preflight", "PreflightPassed", "Running"):
        wait_event(cluster, namespace, "RLJob", job, reason)

    cluster.kubectl(
        "label", "pod", f"{job}-trainer-1", "-n", namespace, "lockstep.dev/inject-failure=container"
    )
    restart = wait_event(cluster, namespace, "TrainerGroup", f"{job}-trainer", "GangRestart")
    assert (
        restart["type"] == "Warning"
        and "rank 1" in restart["message"]
        and "restart 1 of" in restart["message"]
    )
    on_job = wait_event(cluster, namespace, "RLJob", job, "GangRestart")
    assert on_job["message"].startswith(f"TrainerGroup {job}-trainer: rank 1")

    cluster.kubectl("scale", "rolloutpool", f"{job}-rollout", "-n", namespace, "--replicas=2")
    scaled = wait_event(cluster, namespace, "RolloutPool", f"{job}-rollout", "Scaled")
    assert scaled["type"] == "Normal" and scaled["message"] == "replicas 1 -> 2"
    wait_event(cluster, namespace, "RLJob", job, "Scaled")

    described = cluster.kubectl("describe", "rljob", job, "-n", namespace).stdout
    for reason in ("Pending", "Running", "GangRestart", "Scaled"):
        assert reason in described, described
    assert "lockstep-operator" in described  # the From column


def test_a_failed_preflight_is_a_warning_event(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    job = "preflight-event"
    cluster.apply(tiny(job), namespace=namespace)
    phase_is(cluster, namespace, job, "Preflight")
    report(
        cluster,
        namespace,
        job,
        step=0,
        weightVersion=0,
        preflight="failed",
        preflightMismatched=["lm_head.weight"],
    )
    phase_is(cluster, namespace, job, "Failed")
    failed = wait_event(cluster, namespace, "RLJob", job, "PreflightFailed")
    assert failed["type"] == "Warning" and "lm_head.weight" in failed["message"]
    ended = wait_event(cluster, namespace, "RLJob", job, "Failed")
    assert ended["type"] == "Warning" and ended["message"].startswith("PreflightFailed:")
    wait_event(cluster, namespace, "WeightChannel", f"{job}-weights", "PreflightFailed")


def test_a_refused_child_is_a_condition_and_a_warning_and_backs_off(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    """A ResourceQuota of 1 pod: the pool's engine (or the driver) is refused; the job says so with
    the API's message, the retries back off, and lifting the quota lets the job proceed."""
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "one-pod", "namespace": namespace},
             "spec": {"hard": {"pods": "1"}}}  # fmt: skip
    cluster.apply(quota)
    cluster.wait_for(
        lambda: (cluster.get("resourcequota", "one-pod", "-n", namespace).get("status") or {}).get("hard"),
        timeout=WAIT,
        what="the quota in force",
    )
    job = "refused"
    cluster.apply(tiny(job, rollout={"replicas": 2}), namespace=namespace)

    def refused() -> dict[str, Any] | None:
        st = status(cluster, namespace, "rljob", job)
        found = cond(st, "ReconcileError")
        return st if found.get("status") == "True" else None

    st = cluster.wait_for(refused, timeout=WAIT, what="ReconcileError on the job")
    assert st is not None
    error = cond(st, "ReconcileError")
    assert error["reason"] == "QuotaExceeded" and "exceeded quota: one-pod" in error["message"], error
    assert st.get("phase"), "a refused job still shows a phase"
    warn = wait_event(cluster, namespace, "RLJob", job, "ReconcileError")
    assert warn["type"] == "Warning" and "exceeded quota" in warn["message"]

    # Backoff: over 12 s the refused passes are few (1, 2, 4, 8 s apart), not one per second per event.
    def attempts() -> int:
        return sum(
            int(e.get("count") or 1)
            for kind, name in (
                ("RolloutPool", f"{job}-rollout"),
                ("TrainerGroup", f"{job}-trainer"),
                ("RLJob", job),
            )
            for e in events(cluster, namespace, kind, name)
            if e["reason"] == "ReconcileError"
            and not e["message"].startswith(("RolloutPool", "TrainerGroup"))
        )

    before = attempts()
    asyncio.run(asyncio.sleep(12))
    during = attempts() - before
    assert during <= 3 * 4, f"{during} refused passes in 12 s: no backoff"

    cluster.kubectl("delete", "resourcequota", "one-pod", "-n", namespace)
    running(cluster, namespace, job, "engine", 2)
    running(cluster, namespace, job, "trainer", 1)
    cluster.wait_for(
        lambda: not cond(status(cluster, namespace, "rljob", job), "ReconcileError"),
        timeout=180,  # the longest backoff in this test is well under the 120 s cap
        what="ReconcileError removed once the children exist",
    )
    wait_event(cluster, namespace, "RLJob", job, "Reconciled")


def test_the_sink_deduplicates_combines_and_rate_limits(cluster: ControlPlane, namespace: str) -> None:
    burst = 5
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "subject", "namespace": namespace}}
    cluster.apply(cm)
    body = cluster.get("configmap", "subject", "-n", namespace)
    ref = ObjectRef.of(body)
    now = [0.0]

    async def scenario() -> list[bool]:
        async with KubeClient(await load_credentials(str(cluster.kubeconfig))) as kube:
            sink = EventSink(kube, instance="test", burst=burst, refill_s=60.0, similar_limit=2, clock=lambda: now[0],
                             wall=lambda: dt.datetime(2026, 12, 4, 23, 0, tzinfo=dt.UTC))  # fmt: skip
            out = [
                await sink.post(ref, warning(Reason.ENGINE_REPLACED, "engine e-0 ended")) for _ in range(3)
            ]
            out += [await sink.post(ref, normal(Reason.SCALED, f"replicas {i} -> {i + 1}")) for i in range(3)]
            out.append(await sink.post(ref, normal(Reason.RUNNING, "dropped: over the burst")))
            now[0] += 60.0  # one token back
            out.append(await sink.post(ref, normal(Reason.RUNNING, "after the refill")))
            roomy = EventSink(kube, instance="test", similar_limit=2, clock=lambda: now[0])
            for i in range(3):  # the third distinct message of one reason within the window is combined
                out.append(
                    await roomy.post(ref, normal(Reason.AUTOSCALED, f"replicas {i} -> {i + 1}: queue empty"))
                )
            return out

    posted = asyncio.run(scenario())
    assert posted == [True] * 5 + [False, False, True] + [True] * 3
    found = {(e["reason"], e["message"]): e for e in events(cluster, namespace, "ConfigMap", "subject")}
    assert found[("EngineReplaced", "engine e-0 ended")]["count"] == 3  # one object, count raised
    assert ("Scaled", "replicas 0 -> 1") in found and ("Scaled", "replicas 1 -> 2") in found
    # The 3rd distinct Scaled message would have been combined, but the bucket (5) was empty by then.
    assert not any(m.startswith("(combined") for r, m in found if r == "Scaled")
    assert ("Autoscaled", "(combined from similar events): replicas 2 -> 3: queue empty") in found
    assert ("Running", "after the refill") in found and ("Running", "dropped: over the burst") not in found
    assert all(e["source"]["component"] == "lockstep-operator" for e in found.values())
    assert json.dumps(found[("Scaled", "replicas 0 -> 1")]["involvedObject"]["uid"]) == json.dumps(ref.uid)
