"""TrainerGroup reconcile: rank pods `<group>-<rank>` with torchrun env, the headless Service, gang restarts.

Why it exists: the trainer is one torch.distributed world, so the group lives and restarts as a gang
(policy.gang_restart says when and which pods go). Steps:
1. headless Service named like the group (the rank pods' subdomain: stable DNS for MASTER_ADDR) and
   the NetworkPolicy of the rank pods (control port from the driver only; resources.network);
2. observe the rank pods against a fresh rendering of each rank (resources.ranks), with the driver's
   `done` (progress channel) and whether the generation was complete, and ask gang_restart; before a
   restart, `done` is read again from the API server (the rank pods' and the ConfigMap's watch events
   may arrive out of order at the job's end); a counted restart writes status.restarts first (a crash
   here cannot lose the count);
3. delete what the decision says, then create the missing ranks of the current generation, packed
   into one NVLink domain when the product has them (the clique is picked once, kept in an annotation),
   and record the generation as complete (annotation gang-complete; cleared before a roll or a stop
   deletes ranks);
4. status: world size, ready ranks, restarts, conditions.

Who calls it: lockstep_operator.handlers (group events, rank pod events, the periodic re-check).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from lockstep.api.trainergroup import TrainerGroup, TrainerGroupSpec, TrainerGroupStatus
from pydantic import ValidationError

from lockstep_operator.k8s.client import KubeClient, Manifest
from lockstep_operator.k8s.events import Recorder
from lockstep_operator.policy.condition import condition, is_true
from lockstep_operator.policy.events import trainer_events
from lockstep_operator.policy.gang_restart import GangDecision, RankPod, gang_restart
from lockstep_operator.reconcile.common import annotations_of, ensure_baseline, previous_status, write_status
from lockstep_operator.reconcile.placement import plan_cliques
from lockstep_operator.reconcile.progress import ProgressReport, read_progress
from lockstep_operator.reconcile.status import trainer_status
from lockstep_operator.resources.annotations import Annotation
from lockstep_operator.resources.common import (
    API_VERSION,
    LABEL_RANK,
    Owner,
    progress_name,
    selector,
    used_pool,
)
from lockstep_operator.resources.network import trainer_network_policy
from lockstep_operator.resources.pods import selector_labels, template_hash_of
from lockstep_operator.resources.ranks import gpus_per_pod, rank_manifest
from lockstep_operator.resources.services import headless_service
from lockstep_operator.settings import OperatorSettings


def _generation(pod: Manifest) -> int:
    return int((annotations_of(pod).get(Annotation.GANG_GENERATION)) or -1)


def _why(pod: Manifest) -> str:
    """`rank R (pod P) failed: reason (exit N): message` from the pod's container status, or, for a
    pod that Succeeded, `rank R (pod P) exited 0 before the job completed` (read only then)."""
    rank = pod["metadata"]["labels"].get(LABEL_RANK, "?")
    if (pod.get("status") or {}).get("phase") == "Succeeded":
        return f"rank {rank} (pod {pod['metadata']['name']}) exited 0 before the job completed"
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term and term.get("exitCode", 0) != 0:
            return (
                f"rank {rank} (pod {pod['metadata']['name']}) failed: {term.get('reason', 'Error')} "
                f"(exit {term.get('exitCode')}): {term.get('message', '')}".rstrip(": ")
            )
    return f"rank {rank} (pod {pod['metadata']['name']}) failed"


async def reconcile_trainer(
    kube: KubeClient,
    namespace: str,
    name: str,
    *,
    settings: OperatorSettings,
    now: dt.datetime,
    recorder: Recorder | None = None,
) -> None:
    """One pass over TrainerGroup `namespace/name`."""
    body = await kube.get(API_VERSION, "TrainerGroup", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    try:
        spec = TrainerGroup.model_validate(body).spec
    except ValidationError:
        return
    owner, ann = Owner.of(body), annotations_of(body)
    previous = previous_status(body, TrainerGroupStatus)
    generation = body["metadata"].get("generation")
    labels = selector_labels(spec.job, trainer=name)
    shared = ann.get(Annotation.SHARED_POOL) or None  # a standalone pool (rollout.poolRef)
    policy = trainer_network_policy(
        owner, job=spec.job, trainer=name, pool=used_pool(spec.job, shared), pool_job=shared
    )
    service = headless_service(owner, job=spec.job, name=name, selector=labels)
    pods = await kube.list("v1", "Pod", namespace, selector=selector(labels))
    restarts = previous.restarts if previous else 0
    failed_before = (
        condition(previous.conditions, "Failed")
        if previous and is_true(previous.conditions, "Failed")
        else None
    )
    expected = {r: template_hash_of(m) for r, m in _rendered(owner, spec, ann, restarts, settings).items()}
    observed = [_observed(p, expected) for p in pods]
    limit = int(ann.get(Annotation.RESTART_LIMIT) or settings.gang_restart_limit_default)
    progress = await _progress(kube, namespace, spec.job)

    def decide(progress: ProgressReport | None) -> GangDecision:
        return gang_restart(
            observed,
            ranks=spec.trainer.nodes,
            restarts=restarts,
            limit=limit,
            stopped=ann.get(Annotation.SUSPENDED) == "true" or bool(ann.get(Annotation.STOPPED)),
            failed=failed_before.message if failed_before else None,
            done=progress is not None and progress.done,
            complete=ann.get(Annotation.GANG_COMPLETE) == str(restarts),
        )

    decision = decide(progress)
    if decision.faults:  # a rank ended or vanished: did the driver report `done` just before?
        progress = await _progress(kube, namespace, spec.job, fresh=True)
        decision = decide(progress)
    if decision.restarts > restarts:  # written before any deletion: the count survives a crash here
        await _write(kube, body, previous, spec, [], decision, None, now, generation, progress)
    if (decision.stopped or decision.rolling) and ann.get(Annotation.GANG_COMPLETE):
        await _mark_complete(kube, body, "")  # before the deletions: ranks gone now are no fault
    for pod_name in decision.delete:
        await kube.delete("v1", "Pod", namespace, pod_name)
    keep = [p for p in pods if p["metadata"]["name"] in decision.keep]
    if decision.start_missing:
        await ensure_baseline(kube, namespace)  # before any rank: closed until its policy follows
        await _create_missing(kube, owner, spec, body, keep, decision.restarts, settings)
        if annotations_of(body).get(Annotation.GANG_COMPLETE) != str(decision.restarts):
            await _mark_complete(kube, body, str(decision.restarts))  # every rank exists now
    # After the ranks (a burst gets its pods sooner): their headless Service and NetworkPolicy.
    await asyncio.gather(kube.apply(service, cache=True), kube.apply(policy, cache=True))
    rolling = expected.get(0) if decision.rolling else None
    status = await _write(kube, body, previous, spec, keep, decision, rolling, now, generation, progress)
    if recorder is not None:
        events = trainer_events(
            previous.conditions if previous else [],
            status.conditions,
            restarts_before=restarts,
            restarts=decision.restarts,
            limit=limit,
            failed_before=failed_before is not None,
            failed=decision.failed,
            broken=decision.faults,
        )
        recorder.record(body, *events, job_too=True)


def _observed(pod: Manifest, expected: dict[int, str | None]) -> RankPod:
    """A rank pod as the gang policy sees it (its template compared with a fresh rendering)."""
    phase = (pod.get("status") or {}).get("phase")
    return RankPod(
        name=pod["metadata"]["name"],
        rank=_rank(pod),
        generation=_generation(pod),
        current_template=template_hash_of(pod) == expected.get(_rank(pod)),
        terminating=_terminating(pod),
        failed=phase == "Failed",
        succeeded=phase == "Succeeded",
        why=_why(pod) if phase in ("Failed", "Succeeded") else "",
    )


async def _progress(
    kube: KubeClient, namespace: str, job: str, *, fresh: bool = False
) -> ProgressReport | None:
    """The driver's last report (None when there is none or it does not parse; the job shows why)."""
    report, _ = read_progress(await kube.get("v1", "ConfigMap", namespace, progress_name(job), fresh=fresh))
    return report


async def _mark_complete(kube: KubeClient, body: Manifest, generation: str) -> None:
    """Record annotation gang-complete on the group (`generation`, or "" to clear it)."""
    meta = body["metadata"]
    patch = {"metadata": {"annotations": {Annotation.GANG_COMPLETE.value: generation}}}
    answer = await kube.merge_patch(API_VERSION, "TrainerGroup", meta["namespace"], meta["name"], patch)
    meta["annotations"] = annotations_of(answer)


def _rendered(
    owner: Owner, spec: TrainerGroupSpec, ann: dict[str, str], restarts: int, settings: OperatorSettings
) -> dict[int, Manifest]:
    """Every rank pod of generation `restarts` as it would be created now (their hashes are the target)."""
    return {
        rank: rank_manifest(
            owner,
            spec,
            rank,
            generation=restarts,
            gang_min=int(ann.get(Annotation.GANG_MIN, "0") or 0),
            clique=ann.get(Annotation.CLIQUE),
            shared_volume=ann.get(Annotation.SHARED_VOLUME),
            image=settings.runtime_image,
            config_hash=ann.get(Annotation.CONFIG_HASH, ""),
            p2p_rdma=settings.rdma_resource if ann.get(Annotation.P2P_RANKS) == "true" else None,
            facts=settings.node_facts(),
            shared_pool=ann.get(Annotation.SHARED_POOL) or None,
        )
        for rank in range(spec.trainer.nodes)
    }


def _rank(pod: Manifest) -> int:
    return int(pod["metadata"]["labels"].get(LABEL_RANK, "-1"))


def _terminating(pod: Manifest) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


async def _create_missing(
    kube: KubeClient,
    owner: Owner,
    spec: TrainerGroupSpec,
    body: Manifest,
    keep: list[Manifest],
    restarts: int,
    settings: OperatorSettings,
) -> None:
    present = {_rank(p) for p in keep}
    missing = [r for r in range(spec.trainer.nodes) if r not in present]
    if not missing:
        return
    ann = annotations_of(body)
    clique = ann.get(Annotation.CLIQUE)
    if clique is None:
        clique = await _choose_clique(kube, spec, settings) or ""
        meta = body["metadata"]
        await kube.merge_patch(
            API_VERSION,
            "TrainerGroup",
            meta["namespace"],
            meta["name"],
            {"metadata": {"annotations": {Annotation.CLIQUE.value: clique}}},
        )
    rendered = _rendered(owner, spec, {**ann, Annotation.CLIQUE.value: clique}, restarts, settings)
    await asyncio.gather(*(kube.create_or_apply(rendered[rank]) for rank in missing))


async def _choose_clique(kube: KubeClient, spec: TrainerGroupSpec, settings: OperatorSettings) -> str | None:
    """For a TrainerGroup created without the job's placement plan: pick a clique now."""
    clique, _ = await plan_cliques(
        kube,
        product=settings.node_facts().product_label(spec.placement.gpu_product.value),
        ranks=spec.trainer.nodes,
        gpus_per_rank=gpus_per_pod(spec),
        engines=0,
        gpus_per_engine=0,
    )
    return clique or None


async def _write(
    kube: KubeClient,
    body: Manifest,
    previous: TrainerGroupStatus | None,
    spec: TrainerGroupSpec,
    live: list[Manifest],
    decision: GangDecision,
    rolling: str | None,
    now: dt.datetime,
    generation: Any,
    progress: ProgressReport | None,
) -> TrainerGroupStatus:
    status = trainer_status(
        live,
        nodes=spec.trainer.nodes,
        gpus_per_node=spec.trainer.gpus_per_node,
        restarts=decision.restarts,
        failed=decision.failed,
        previous=previous,
        step=progress.step if progress else None,
        rolling=rolling,
        generation=generation,
        now=now,
    )
    if await write_status(kube, body, previous, status):
        body["status"] = status.wire()
    return status
