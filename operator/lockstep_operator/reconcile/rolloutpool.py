"""RolloutPool reconcile: engine pods `<pool>-<i>` for i < replicas, the router Service, autoscaling.

Why it exists: the pool is the scaling unit of rollout. Its pods have stable names (like a
StatefulSet), so a reconcile that dies halfway and runs again finds and keeps what exists. Steps:
1. router Service (ClusterIP over the pool's Ready engine pods) and the headless engines Service (every
   engine, ready or not: the driver asks each for its weight version);
2. replace failed engines (delete Failed pods; they are recreated below once gone);
3. remove replicas above the desired count (0 while suspended or stopped), create missing ones;
   replicas below the gang's minimum carry the gang-member keys; replace engines whose pod-template
   hash differs from a fresh rendering (the spec changed) one at a time (lockstep_operator.roll);
4. the built-in autoscaler (spec.autoscaling set, not handed to HPA/KEDA with the
   rl.lockstep.dev/autoscaler=external annotation): record the driver's queue sample once per step,
   ask lockstep_operator.autoscale.decide_replicas, patch spec.replicas (the /scale field);
5. the readiness gate of each engine pod (condition rl.lockstep.dev/weights-current: the driver reports
   it at the current weight version, status.weights_current), then the status: per-engine readiness
   and weight version (from the progress channel), selector for /scale.

Who calls it: lockstep_operator.handlers (pool events, engine pod events, the periodic re-check).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from typing import Any

from lockstep.api.rolloutpool import RolloutPool, RolloutPoolSpec, RolloutPoolStatus
from pydantic import ValidationError

from lockstep_operator.autoscale import QueueSample, ScalePolicy, decide_replicas
from lockstep_operator.k8s.client import KubeClient, Manifest
from lockstep_operator.reconcile.common import (
    ANN_AUTOSCALER,
    ANN_AVOID_CLIQUE,
    ANN_GANG_MIN,
    ANN_LAST_SCALED,
    ANN_QUEUE_HISTORY,
    ANN_SHARED_VOLUME,
    ANN_STOPPED,
    ANN_SUSPENDED,
    annotations_of,
    previous_status,
    write_status,
)
from lockstep_operator.reconcile.progress import ProgressReport, read_progress
from lockstep_operator.reconcile.status import engine_ready, pool_status, weights_current
from lockstep_operator.resources import podgroups
from lockstep_operator.resources.commands import engine_command, product_label
from lockstep_operator.resources.common import (
    API_VERSION,
    LABEL_REPLICA,
    WEIGHTS_CURRENT,
    Owner,
    engines_service_name,
    progress_name,
    router_name,
    selector,
)
from lockstep_operator.resources.pods import (
    Container,
    Placement,
    engine_pod,
    selector_labels,
    template_hash_of,
    with_template_hash,
)
from lockstep_operator.resources.services import engines_service, router_service
from lockstep_operator.roll import EngineState, engines_to_roll
from lockstep_operator.settings import OperatorSettings

HISTORY = 32
"""Queue samples kept in the pool annotation (enough for the policy's window)."""


def engine_placement(spec: RolloutPoolSpec, avoid_clique: str | None = None) -> Placement:
    """GPU requests and node selection of one engine replica."""
    place = spec.placement
    return Placement(
        gpus=spec.engine.gpus_per_engine,
        product=product_label(place.gpu_product.value),
        node_selector=dict(place.node_selector),
        tolerations=[t.wire() for t in place.tolerations],
        avoid_clique=avoid_clique or None,
    )


def engine_manifest(
    owner: Owner,
    spec: RolloutPoolSpec,
    replica: int,
    *,
    gang_min: int,
    image: str,
    shared_volume: str | None = None,
    avoid_clique: str | None = None,
) -> Manifest:
    """Engine pod `replica` of the pool (pure), annotated with its pod-template hash (the pod spec:
    image, command with the engine arguments, resources, placement; never replicas or gang membership)."""
    gang = spec.placement.gang
    keys = podgroups.member_keys(
        job=spec.job,
        scheduler=gang.scheduler.value,
        min_member=gang_min,
        queue=gang.queue_name,
        member=replica < _pool_min(spec),
    )
    container = Container(
        image=spec.engine.image or image,
        command=engine_command(spec.engine, spec.model),
        shared_volume_claim=shared_volume or None,
    )
    pod = engine_pod(
        owner,
        job=spec.job,
        pool=owner.name,
        replica=replica,
        container=container,
        placement=engine_placement(spec, avoid_clique),
        gang=keys,
    )
    return with_template_hash(pod)


def _pool_min(spec: RolloutPoolSpec) -> int:
    return int(min(spec.autoscaling.min_replicas, spec.replicas) if spec.autoscaling else spec.replicas)


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
    pods = await kube.list("v1", "Pod", namespace, selector=selector(labels))
    stopped = ann.get(ANN_SUSPENDED) == "true" or bool(ann.get(ANN_STOPPED))
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
            gang_min=int(ann.get(ANN_GANG_MIN, "0") or 0),
            image=settings.engine_image if spec.engine.engine.value == "sglang" else settings.runtime_image,
            shared_volume=ann.get(ANN_SHARED_VOLUME),
            avoid_clique=ann.get(ANN_AVOID_CLIQUE),
        ),
    )
    for pod in live:
        await _set_weights_gate(kube, pod, weights_current(pod, version, versions, addresses), now)
    if spec.autoscaling is not None and ann.get(ANN_AUTOSCALER) != "external" and not stopped:
        await _autoscale(kube, body, spec, progress, now.timestamp(), settings)
    previous = previous_status(body, RolloutPoolStatus)
    status = pool_status(
        live,
        selector=selector(labels),
        current_version=version,
        engine_versions=versions,
        address_versions=addresses,
        min_replicas=0 if stopped else _pool_min(spec),
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
        if index >= desired or index < 0 or phase in ("Failed", "Succeeded"):
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
    roll = engines_to_roll(states, desired=desired, min_ready=_pool_min(spec))
    for name in roll:
        await kube.delete("v1", "Pod", owner.namespace, name)
    live = [p for i, p in by_index.items() if 0 <= i < desired and not _dying(p)]
    live = [p for p in live if p["metadata"]["name"] not in roll]
    for index in range(desired):
        if index not in by_index:
            await kube.apply(rendered[index])
    return live


async def _set_weights_gate(
    kube: KubeClient, pod: Manifest, verdict: tuple[bool, str], now: dt.datetime
) -> None:
    """Set the engine pod's readiness-gate condition (rl.lockstep.dev/weights-current) when it changed.

    Server-side apply of that one condition on pods/status (conditions merge by type), so the kubelet's
    own conditions are untouched; the kubelet then counts the pod Ready only while it is True.
    """
    current, message = verdict
    value = "True" if current else "False"
    conditions = (pod.get("status") or {}).get("conditions") or []
    old = next((c for c in conditions if c.get("type") == WEIGHTS_CURRENT), None)
    if old is not None and old.get("status") == value and old.get("message") == message:
        return
    changed = old is None or old.get("status") != value
    condition = {
        "type": WEIGHTS_CURRENT,
        "status": value,
        "reason": "WeightsCurrent" if current else "WeightsBehind",
        "message": message,
        "lastTransitionTime": now.isoformat().replace("+00:00", "Z")
        if changed
        else old.get("lastTransitionTime")
        if old
        else None,
    }
    meta = pod["metadata"]
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "status": {"conditions": [condition]},
    }
    await kube.apply(body, subresource="status")


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
    history: list[list[Any]] = json.loads(ann.get(ANN_QUEUE_HISTORY, "[]"))
    patch_ann: dict[str, str] = {}
    fresh = (
        progress is not None
        and progress.step is not None
        and (not history or history[-1][1] != progress.step)
    )
    if progress and fresh and progress.queue_size is not None and progress.queue_capacity:
        history = [*history, [now, progress.step, progress.queue_size, progress.queue_capacity]][-HISTORY:]
        patch_ann[ANN_QUEUE_HISTORY] = json.dumps(history)
    last = json.loads(ann.get(ANN_LAST_SCALED, "null"))
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
        patch_ann[ANN_LAST_SCALED] = json.dumps([now, history[-1][1] if history else None])
    if patch_ann:
        patch["metadata"] = {"annotations": patch_ann}
    if patch:
        meta = body["metadata"]
        await kube.merge_patch(API_VERSION, "RolloutPool", meta["namespace"], meta["name"], patch)
