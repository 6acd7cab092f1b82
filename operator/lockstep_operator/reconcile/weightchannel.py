"""WeightChannel reconcile: pick the transport from where the pods landed; fold in the preflight result.

Why it exists: the right transport depends on the nodes the trainer ranks and the engines actually
run on (§7.2.5): same GPUs -> cuda-ipc, RDMA on >= 2 nodes per side -> p2p, a shared network ->
broadcast, only a shared ReadWriteMany volume -> disk-delta. An explicit spec.weightSync.transport
wins if feasible; otherwise the automatic choice is used and the condition
RequestedTransportFeasible=False says why. The driver's pre-flight weight-equality result (progress
channel) becomes PreflightPassed, which gates the RLJob's Running phase.

Steps: list the trainer and engine pods, read their nodes' facts (labels, allocatable), decide with
lockstep_operator.topology.choose_transport (pure), compute the status, write it if changed. While
pods are unscheduled the previous choice is kept.

Who calls it: lockstep_operator.handlers (channel events, pod events of the job, the re-check).
"""

from __future__ import annotations

import datetime as dt
from typing import cast

from lockstep.api.weightchannel import WeightChannel, WeightChannelStatus
from pydantic import ValidationError

from lockstep_operator.k8s.client import KubeClient, Manifest
from lockstep_operator.k8s.events import Recorder
from lockstep_operator.policy.events import channel_events
from lockstep_operator.reconcile.common import annotations_of, previous_status, write_status
from lockstep_operator.reconcile.progress import read_progress
from lockstep_operator.reconcile.status import channel_status
from lockstep_operator.resources.annotations import Annotation
from lockstep_operator.resources.colocation import CPU_NOTHING_TO_SHARE
from lockstep_operator.resources.common import API_VERSION, LABEL_POOL, LABEL_ROLE, progress_name, selector
from lockstep_operator.resources.pods import selector_labels
from lockstep_operator.topology import Decision, NodeFacts, Transport, choose_transport


async def _node_facts(
    kube: KubeClient, pods: list[Manifest], cache: dict[str, NodeFacts]
) -> list[NodeFacts] | None:
    """Facts of the nodes under `pods`; None while any live pod is unscheduled."""
    facts = []
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp") or (pod.get("status") or {}).get("phase") == "Failed":
            continue
        node = (pod.get("spec") or {}).get("nodeName")
        if not node:
            return None
        if node not in cache:
            found = await kube.get("v1", "Node", None, node)
            if found is None:
                return None
            cache[node] = NodeFacts.from_node(found)
        facts.append(cache[node])
    return facts


async def reconcile_channel(
    kube: KubeClient, namespace: str, name: str, *, now: dt.datetime, recorder: Recorder | None = None
) -> None:
    """One pass over WeightChannel `namespace/name`."""
    body = await kube.get(API_VERSION, "WeightChannel", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    try:
        spec = WeightChannel.model_validate(body).spec
    except ValidationError:
        return
    colocate = annotations_of(body).get(Annotation.COLOCATE)
    colocated = colocate == "true"
    no_ipc = CPU_NOTHING_TO_SHARE if colocate == "cpu" else None
    # Absent on channels written before the key existed: the reference engine was the only one with P2P.
    engine_p2p = annotations_of(body).get(Annotation.ENGINE_P2P, "true") == "true"
    sel_t = selector(selector_labels(spec.job, trainer=spec.trainer_group))
    # by pool alone: a standalone pool's engines carry the pool's name, not the job's (rollout.poolRef)
    sel_e = selector({LABEL_POOL: spec.rollout_pool, LABEL_ROLE: "engine"})
    cache: dict[str, NodeFacts] = {}
    trainer = await _node_facts(kube, await kube.list("v1", "Pod", namespace, selector=sel_t), cache)
    engines = await _node_facts(kube, await kube.list("v1", "Pod", namespace, selector=sel_e), cache)
    sync = spec.weight_sync
    requested = None if sync.transport.value == "auto" else cast(Transport, sync.transport.value)
    if trainer is None or engines is None:
        decision = Decision(None, "waiting for trainer and engine pods to be scheduled", ())
    else:
        decision = choose_transport(
            trainer,
            engines,
            colocated=colocated,
            shared_volume=sync.disk_delta.volume_claim is not None,
            requested=requested,
            engine_p2p=engine_p2p,
            no_ipc=no_ipc,
        )
    progress, _ = read_progress(await kube.get("v1", "ConfigMap", namespace, progress_name(spec.job)))
    previous = previous_status(body, WeightChannelStatus)
    status = channel_status(
        decision, progress=progress, previous=previous, generation=body["metadata"].get("generation"), now=now
    )
    if await write_status(kube, body, previous, status) and recorder is not None:
        recorder.record(body, *channel_events(previous, status))
