"""A standalone pool's step that unloads the adapters of deleted and ended jobs from its engines.

Why it exists: see lockstep_operator.policy.adapter_gc (the plan) and resources.adapter_gc (the pod that
does it). Each pass over a standalone rollout pool that serves LoRA:
1. plan from the pool's annotation rl.lockstep.dev/adapters and the namespace's RLJobs;
2. for each stale name: no unload pod yet -> create one against the serving engines (none serving:
   nothing holds it, forget it); Succeeded -> delete it, forget the name (event AdapterUnloaded);
   Failed -> delete it (the next pass creates a new one; event AdapterUnloadFailed with its reason);
3. an unload pod whose name a live job uses again is deleted (that job sweeps its predecessor's
   versions itself: lockstep.weights.adapter.AdapterSync.follow);
4. the annotation is written only when the remembered names change.
The unload pod's events kick the pool (handlers.pod_event), so each step follows the last.

Who calls it: lockstep_operator.reconcile.rolloutpool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lockstep_operator.k8s.client import ApiError, KubeClient, Manifest
from lockstep_operator.policy.adapter_gc import encode, plan, recorded
from lockstep_operator.policy.events import Event, Reason, normal, warning
from lockstep_operator.reconcile.common import annotations_of
from lockstep_operator.resources.adapter_gc import engine_url, unload_labels, unload_pod
from lockstep_operator.resources.annotations import Annotation
from lockstep_operator.resources.common import API_VERSION, Owner, selector


def serving(pod: Manifest) -> bool:
    """An engine that may hold adapters: running with an address and its container ready."""
    status = pod.get("status") or {}
    ready = any(
        c.get("type") == "ContainersReady" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    return status.get("phase") == "Running" and engine_url(pod) is not None and ready


def _reason(pod: Manifest) -> str:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if term:
            return (term.get("message") or term.get("reason") or f"exit {term.get('exitCode')}").strip()[
                -300:
            ]
    return "no reason reported"


async def unload_ended_adapters(
    kube: KubeClient,
    body: Manifest,
    *,
    engines: Sequence[Manifest],
    image: str,
    events: list[Event],
) -> None:
    """One pass of the step over standalone pool `body` (see the module doc); `engines`: its live pods."""
    meta = body["metadata"]
    namespace, pool = meta["namespace"], meta["name"]
    before = recorded(annotations_of(body).get(Annotation.POOL_ADAPTERS))
    the_plan = plan(before, await kube.list(API_VERSION, "RLJob", namespace), pool)
    pods = await kube.list("v1", "Pod", namespace, selector=selector(unload_labels(pool)))
    by_adapter: dict[str, Manifest] = {
        str((p["metadata"].get("annotations") or {}).get(Annotation.ADAPTER, "")): p for p in pods
    }
    up = [e for e in engines if serving(e)]
    done: set[str] = set()
    for adapter in sorted(the_plan.stale):
        pod = by_adapter.pop(adapter, None)
        if pod is None:
            if not up:  # no engine serves: none holds it (an engine that restarts loads nothing)
                done.add(adapter)
                continue
            manifest = unload_pod(Owner.of(body), pool=pool, adapter=adapter, engines=up, image=image)
            try:
                await kube.create(manifest)
            except ApiError as err:
                if err.status != 409:
                    raise
            continue
        if pod["metadata"].get("deletionTimestamp"):
            continue
        phase = (pod.get("status") or {}).get("phase")
        if phase == "Succeeded":
            done.add(adapter)
            await kube.delete("v1", "Pod", namespace, pod["metadata"]["name"])
            events.append(
                normal(
                    Reason.ADAPTER_UNLOADED, f"adapter {adapter} (no job uses it) unloaded from every engine"
                )
            )
        elif phase == "Failed":
            await kube.delete("v1", "Pod", namespace, pod["metadata"]["name"])
            events.append(
                warning(
                    Reason.ADAPTER_UNLOAD_FAILED,
                    f"unloading adapter {adapter} failed ({_reason(pod)}); trying again",
                )
            )
    for pod in by_adapter.values():  # its name is used again, or forgotten
        if not pod["metadata"].get("deletionTimestamp"):
            await kube.delete("v1", "Pod", namespace, pod["metadata"]["name"])
    record = the_plan.record - done
    if record != before:
        patch: dict[str, Any] = {
            "metadata": {"annotations": {Annotation.POOL_ADAPTERS.value: encode(record)}}
        }
        await kube.merge_patch(API_VERSION, "RolloutPool", namespace, pool, patch)
