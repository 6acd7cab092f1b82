"""RolloutPool reconcile: engine pods `<pool>-<i>` for i < replicas, the router Service, autoscaling.

Why it exists: the pool is the scaling unit of rollout. Its pods have stable names (like a
StatefulSet), so a reconcile that dies halfway and runs again finds and keeps what exists. Steps:
1. router Service (Ready engines) and the headless engines Service (every engine, ready or not);
2. delete Failed and surplus engines (0 while suspended or stopped), create missing ones (rendered by
   resources.engines; replicas below min_available are gang members), roll stale ones one at a
   time (policy.roll);
3. the built-in autoscaler unless annotated external: record the driver's queue sample once per
   step, ask policy.autoscale.decide_replicas, patch spec.replicas (the /scale field);
4. each engine's readiness gate (rl.lockstep.dev/weights-current, from the progress report), then the
   status: per-engine readiness and weight version, selector for /scale.
Who calls it: lockstep_operator.handlers (pool events, engine pod events, the periodic re-check).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from typing import Any

from lockstep.api.rolloutpool import RolloutPool, RolloutPoolSpec, RolloutPoolStatus
from pydantic import ValidationError

from lockstep_operator.k8s.client import KubeClient, Manifest
from lockstep_operator.policy.autoscale import QueueSample, ScalePolicy, decide_replicas
from lockstep_operator.policy.job_observed import init_failure
from lockstep_operator.policy.roll import EngineState, engines_to_roll
from lockstep_operator.reconcile.common import annotations_of, previous_status, write_status
from lockstep_operator.reconcile.progress import ProgressReport, read_progress
from lockstep_operator.reconcile.status import engine_ready, pool_status, weights_current
from lockstep_operator.resources.annotations import Annotation
from lockstep_operator.resources.common import (
    API_VERSION,
    LABEL_REPLICA,
    Owner,
    engines_service_name,
    progress_name,
    router_name,
    selector,
    trainer_name,
)
from lockstep_operator.resources.engines import engine_manifest, weights_gate
from lockstep_operator.resources.network import engine_network_policy
from lockstep_operator.resources.pods import selector_labels, template_hash_of
from lockstep_operator.resources.services import engines_service, router_service
from lockstep_operator.settings import OperatorSettings

HISTORY = 32
"""Queue samples kept in the pool annotation (enough for the policy's window)."""


async def reconcile_pool(
    kube: KubeClient, namespace: str, name: str, *, settings: OperatorSettings, now: dt.datetime
) -> None:
    """One pass over RolloutPool `namespace/name`."""
    body = await kube.get(API_VERSION, "RolloutPool", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    try:
        spec = RolloutPool.model_validate(body).spec
    except ValidationError:
        return  # the apiserver validates the schema; an unreadable pool is left to its owner job
    owner, ann = Owner.of(body), annotations_of(body)
    labels = selector_labels(spec.job, pool=name)
    await kube.apply(router_service(owner, job=spec.job, name=router_name(name), selector=labels), cache=True)
    engines = engines_service(owner, job=spec.job, name=engines_service_name(name), selector=labels)
    await kube.apply(engines, cache=True)
    policy = engine_network_policy(owner, job=spec.job, pool=name, trainer=trainer_name(spec.job))
    await kube.apply(policy, cache=True)
    pods = await kube.list("v1", "Pod", namespace, selector=selector(labels))
    stopped = ann.get(Annotation.SUSPENDED) == "true" or bool(ann.get(Annotation.STOPPED))
    desired = 0 if stopped else spec.replicas
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
        ready=lambda pod: engine_ready(pod, version, versions, addresses),
        render=lambda index: engine_manifest(
            owner,
            spec,
            index,
            gang_min=int(ann.get(Annotation.GANG_MIN, "0") or 0),
            image=settings.engine_image if spec.engine.engine.value == "sglang" else settings.runtime_image,
            shared_volume=ann.get(Annotation.SHARED_VOLUME),
            avoid_clique=ann.get(Annotation.AVOID_CLIQUE),
        ),
    )
    for pod in live:
        gate = weights_gate(pod, weights_current(pod, version, versions, addresses), now)
        if gate is not None:  # server-side apply of the one condition on pods/status
            await kube.apply(gate, subresource="status")
    if spec.autoscaling is not None and ann.get(Annotation.AUTOSCALER) != "external" and not stopped:
        await _autoscale(kube, body, spec, progress, now.timestamp(), settings)
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
    await write_status(kube, body, previous, status)


async def _converge_pods(
    kube: KubeClient,
    owner: Owner,
    spec: RolloutPoolSpec,
    pods: list[Manifest],
    desired: int,
    *,
    ready: Callable[[Manifest], bool],
    render: Callable[[int], Manifest],
) -> list[Manifest]:
    """Delete failed, surplus and (one at a time) stale engines, create missing ones; return the live pods.

    `ready`: whether an engine counts as ready; `render`: engine pod `index` as it would be created now.
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
    live = [p for i, p in by_index.items() if 0 <= i < desired and not _dying(p)]
    live = [p for p in live if p["metadata"]["name"] not in roll]
    for index in range(desired):
        if index not in by_index:
            await kube.apply(rendered[index])
    return live


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
        patch_ann[Annotation.LAST_SCALED.value] = json.dumps([now, history[-1][1] if history else None])
    if patch_ann:
        patch["metadata"] = {"annotations": patch_ann}
    if patch:
        meta = body["metadata"]
        await kube.merge_patch(API_VERSION, "RolloutPool", meta["namespace"], meta["name"], patch)
