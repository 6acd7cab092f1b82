"""RolloutPool reconcile: engine pods `<pool>-<i>` for i < replicas, the router Service, autoscaling.

Why it exists: the pool is the scaling unit of rollout. Its pods have stable names (like a
StatefulSet), so a reconcile that dies halfway and runs again finds and keeps what exists. Steps:
1. router Service (Ready engines) and the headless engines Service (every engine, ready or not);
2. delete Failed and surplus engines (0 while suspended or stopped), create missing ones (rendered by
   resources.engines; replicas below min_available are gang members), roll stale ones one at a
   time (policy.roll);
3. the built-in autoscaler unless annotated external: record the driver's queue sample once per
   step, ask policy.autoscale.decide_replicas, patch spec.replicas (the /scale field);
4. each engine's readiness gate (rl.lockstep.dev/weights-current, from the progress report; a
   standalone pool's from the reports of the jobs sampling on it: an engine holds each one's current
   adapter), then the status: per-engine readiness and weight version, selector for /scale;
5. a standalone pool serving LoRA unloads the adapters of deleted and ended jobs from its engines
   (reconcile.adapter_gc).
Who calls it: lockstep_operator.handlers (pool events, engine pod events, the periodic re-check).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Callable
from typing import Any

from lockstep.api.rljob import Phase
from lockstep.api.rolloutpool import PoolRole, RolloutPool, RolloutPoolSpec, RolloutPoolStatus
from pydantic import ValidationError

from lockstep_operator.k8s.client import KubeClient, Manifest
from lockstep_operator.k8s.events import Recorder
from lockstep_operator.policy.autoscale import QueueSample, ScalePolicy, decide_replicas
from lockstep_operator.policy.events import Event, Reason, normal, pool_events, warning
from lockstep_operator.policy.job_observed import init_failure
from lockstep_operator.policy.roll import EngineState, engines_to_roll
from lockstep_operator.reconcile.adapter_gc import unload_ended_adapters
from lockstep_operator.reconcile.common import (
    annotations_of,
    ensure_api_key,
    ensure_baseline,
    previous_status,
    write_status,
)
from lockstep_operator.reconcile.progress import ProgressReport, read_progress
from lockstep_operator.reconcile.status import (
    engine_ready,
    pool_status,
    shared_weights_current,
    weights_current,
)
from lockstep_operator.resources.annotations import Annotation
from lockstep_operator.resources.common import (
    API_VERSION,
    LABEL_REPLICA,
    Owner,
    engines_service_name,
    pool_scope,
    progress_name,
    router_name,
    selector,
    trainer_name,
)
from lockstep_operator.resources.config import pool_config_map
from lockstep_operator.resources.engines import engine_manifest, weights_gate
from lockstep_operator.resources.network import engine_network_policy, shared_engine_network_policy
from lockstep_operator.resources.pods import selector_labels, template_hash_of
from lockstep_operator.resources.services import engines_service, router_service
from lockstep_operator.settings import OperatorSettings

HISTORY = 32
"""Queue samples kept in the pool annotation (enough for the policy's window)."""


async def reconcile_pool(
    kube: KubeClient,
    namespace: str,
    name: str,
    *,
    settings: OperatorSettings,
    now: dt.datetime,
    recorder: Recorder | None = None,
) -> None:
    """One pass over RolloutPool `namespace/name`."""
    recorder = recorder or Recorder(None)
    events: list[Event] = []
    body = await kube.get(API_VERSION, "RolloutPool", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    try:
        spec = RolloutPool.model_validate(body).spec
    except ValidationError:
        return  # the apiserver validates the schema; an unreadable pool is left to its owner job
    owner, ann = Owner.of(body), annotations_of(body)
    scope = pool_scope(spec.job, name)  # a standalone pool (no job) names its engines after itself
    labels = selector_labels(scope, pool=name)
    engines = engines_service(owner, job=scope, name=engines_service_name(name), selector=labels)
    router = router_service(owner, job=scope, name=router_name(name), selector=labels)
    if (
        spec.job is None
    ):  # the jobs that use it (rollout.poolRef, a teacher's poolRef) reach it with its own key
        policy = shared_engine_network_policy(owner, pool=name, teacher=spec.role is PoolRole.TEACHER)
        await ensure_api_key(kube, owner, scope)
        await kube.apply(pool_config_map(owner, pool=name, spec=spec.wire()), cache=True)
    else:
        policy = engine_network_policy(owner, job=spec.job, pool=name, trainer=trainer_name(spec.job))
    pods = await kube.list("v1", "Pod", namespace, selector=selector(labels))
    stopped = ann.get(Annotation.SUSPENDED) == "true" or bool(ann.get(Annotation.STOPPED))
    desired = 0 if stopped else spec.replicas
    progress = None
    # A standalone pool serves a base that never changes, a teacher pool weights the job never updates:
    # no job's versions, so their engines are ready once they serve.
    if spec.job is not None and spec.role is not PoolRole.TEACHER:
        progress, _ = read_progress(await kube.get("v1", "ConfigMap", namespace, progress_name(spec.job)))
    version = progress.weight_version if progress else None
    versions = progress.engine_versions if progress else {}
    addresses = (progress.engine_address_versions if progress else None) or {}
    live = await _converge_pods(
        kube,
        owner,
        spec,
        pods,
        desired,
        events,
        ready=lambda pod: engine_ready(pod, version, versions, addresses),
        render=lambda index: engine_manifest(
            owner,
            spec,
            index,
            gang_min=int(ann.get(Annotation.GANG_MIN, "0") or 0),
            image=settings.engine_image if spec.engine.engine.value == "sglang" else settings.runtime_image,
            shared_volume=ann.get(Annotation.SHARED_VOLUME),
            avoid_clique=ann.get(Annotation.AVOID_CLIQUE),
            facts=settings.node_facts(),
            delta_agent=ann.get(Annotation.DELTA_AGENT),
            runtime_image=settings.runtime_image,
        ),
    )
    # After the engines (a burst gets its pods sooner): their Services and NetworkPolicy.
    await asyncio.gather(*(kube.apply(m, cache=True) for m in (router, engines, policy)))
    # A standalone pool's engines follow the adapters of the jobs sampling on it (shared_weights_current).
    users = (
        await _pool_users(kube, namespace, name)
        if spec.job is None and spec.role is not PoolRole.TEACHER
        else None
    )
    for pod in live:
        verdict = (
            weights_current(pod, version, versions, addresses)
            if users is None
            else shared_weights_current(pod, users)
        )
        gate = weights_gate(pod, verdict, now)
        if gate is not None:  # server-side apply of the one condition on pods/status
            await kube.apply(gate, subresource="status")
    if users is not None and spec.model.lora is not None:  # deleted and ended jobs' adapters leave
        await unload_ended_adapters(kube, body, engines=live, image=settings.runtime_image, events=events)
    if spec.autoscaling is not None and ann.get(Annotation.AUTOSCALER) != "external" and not stopped:
        await _autoscale(kube, body, spec, progress, now.timestamp(), settings, events)
    previous = previous_status(body, RolloutPoolStatus)
    status = pool_status(
        live,
        selector=selector(labels),
        current_version=version,
        engine_versions=versions,
        address_versions=addresses,
        min_available=0 if stopped else spec.min_available,
        previous=previous,
        generation=body["metadata"].get("generation"),
        now=now,
    )
    if await write_status(kube, body, previous, status):
        generation = body["metadata"].get("generation")
        events += pool_events(previous, status, generation=generation, replicas=desired)
    recorder.record(body, *events, job_too=True)


async def _pool_users(kube: KubeClient, namespace: str, pool: str) -> list[tuple[str, ProgressReport | None]]:
    """The running jobs whose rollout.poolRef names standalone pool `pool`, with their progress reports
    (a pending, suspended or ended job samples nothing: its adapter does not gate the engines)."""
    out: list[tuple[str, ProgressReport | None]] = []
    for body in await kube.list(API_VERSION, "RLJob", namespace):
        ref = ((body.get("spec") or {}).get("rollout") or {}).get("poolRef") or {}
        phase = (body.get("status") or {}).get("phase")
        if ref.get("name") != pool or phase not in (Phase.PREFLIGHT, Phase.RUNNING):
            continue
        job = body["metadata"]["name"]
        report, _ = read_progress(await kube.get("v1", "ConfigMap", namespace, progress_name(job)))
        out.append((job, report))
    return out


async def _converge_pods(
    kube: KubeClient,
    owner: Owner,
    spec: RolloutPoolSpec,
    pods: list[Manifest],
    desired: int,
    events: list[Event],
    *,
    ready: Callable[[Manifest], bool],
    render: Callable[[int], Manifest],
) -> list[Manifest]:
    """Delete failed, surplus and (one at a time) stale engines, create missing ones; return the live pods.

    `ready`: whether an engine counts as ready; `render`: engine pod `index` as it would be created now.
    A replaced (failed) or rolled engine is appended to `events`.
    """
    by_index: dict[int, Manifest] = {}
    for pod in pods:
        index = int(pod["metadata"]["labels"].get(LABEL_REPLICA, "-1"))
        phase = (pod.get("status") or {}).get("phase")
        terminating = bool(pod["metadata"].get("deletionTimestamp"))
        # An engine whose init step failed (the model pull, the serving checkpoint's conversion) would
        # fail again as a new pod: it is kept, so the job fails with its message (job_failure), until
        # a changed spec renders it differently.
        kept = (
            index in range(desired)
            and init_failure(pod) is not None
            and (template_hash_of(pod) == template_hash_of(render(index)))
        )
        if index >= desired or index < 0 or (phase in ("Failed", "Succeeded") and not kept):
            if not terminating:
                await kube.delete("v1", "Pod", owner.namespace, pod["metadata"]["name"])
                if 0 <= index < desired:
                    why = _ended(pod)
                    events.append(
                        warning(
                            Reason.ENGINE_REPLACED, f"engine {pod['metadata']['name']} {why}: replacing it"
                        )
                    )
            by_index[index] = pod  # the name is still taken until the pod is gone
            continue
        by_index[index] = pod
    rendered = {index: render(index) for index in range(desired)}
    states = [
        EngineState(
            name=pod["metadata"]["name"],
            index=index,
            stale=index in rendered and template_hash_of(pod) != template_hash_of(rendered[index]),
            ready=ready(pod),
            terminating=_dying(pod),
        )
        for index, pod in by_index.items()
    ]
    roll = engines_to_roll(states, desired=desired, min_ready=spec.min_available)
    for name in roll:
        await kube.delete("v1", "Pod", owner.namespace, name)
        events.append(normal(Reason.ENGINE_ROLLED, f"engine {name} runs an old pod template: replacing it"))
    live = [p for i, p in by_index.items() if 0 <= i < desired and not _dying(p)]
    live = [p for p in live if p["metadata"]["name"] not in roll]
    missing = [i for i in range(desired) if i not in by_index]
    if missing:
        await ensure_baseline(kube, owner.namespace)  # before any engine: closed until its policy follows
    await asyncio.gather(*(kube.create_or_apply(rendered[i]) for i in missing))
    return live


def _ended(pod: Manifest) -> str:
    """`failed: <reason> (exit N)` of an engine pod that ended, from its container status."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            return f"ended: {term.get('reason') or 'Error'} (exit {term.get('exitCode')})"
    return f"ended ({(pod.get('status') or {}).get('phase')})"


def _dying(pod: Manifest) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp")) or (pod.get("status") or {}).get("phase") in (
        "Failed",
        "Succeeded",
    )


async def _autoscale(
    kube: KubeClient,
    body: Manifest,
    spec: RolloutPoolSpec,
    progress: ProgressReport | None,
    now: float,
    settings: OperatorSettings,
    events: list[Event],
) -> None:
    """Record the driver's queue sample once per step and apply the policy's decision."""
    assert spec.autoscaling is not None
    ann = annotations_of(body)
    history: list[list[Any]] = json.loads(ann.get(Annotation.QUEUE_HISTORY, "[]"))
    patch_ann: dict[str, str] = {}
    fresh = (
        progress is not None
        and progress.step is not None
        and (not history or history[-1][1] != progress.step)
    )
    if progress and fresh and progress.queue_size is not None and progress.queue_capacity:
        history = [*history, [now, progress.step, progress.queue_size, progress.queue_capacity]][-HISTORY:]
        patch_ann[Annotation.QUEUE_HISTORY.value] = json.dumps(history)
    last = json.loads(ann.get(Annotation.LAST_SCALED, "null"))
    policy = ScalePolicy(
        min_replicas=spec.autoscaling.min_replicas,
        max_replicas=spec.autoscaling.max_replicas,
        window_s=settings.autoscale_window_seconds,
        cooldown_s=settings.autoscale_cooldown_seconds,
    )
    decision = decide_replicas(
        current=spec.replicas,
        policy=policy,
        samples=[QueueSample(*s) for s in history],
        last_scaled_at=last[0] if last else None,
        last_scaled_step=last[1] if last else None,
        now=now,
    )
    patch: dict[str, Any] = {}
    if decision.replicas != spec.replicas:
        patch["spec"] = {"replicas": decision.replicas}
        message = f"replicas {spec.replicas} -> {decision.replicas}: {decision.reason}"
        events.append(normal(Reason.AUTOSCALED, message))
        patch_ann[Annotation.LAST_SCALED.value] = json.dumps([now, history[-1][1] if history else None])
    if patch_ann:
        patch["metadata"] = {"annotations": patch_ann}
    if patch:
        meta = body["metadata"]
        await kube.merge_patch(API_VERSION, "RolloutPool", meta["namespace"], meta["name"], patch)
