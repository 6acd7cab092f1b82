"""TrainerGroup reconcile: rank pods `<group>-<rank>` with torchrun env, the headless Service, gang restarts.

Why it exists: the trainer is one torch.distributed world; a single failed rank makes every other
rank hang in a collective, so the group lives and restarts as a gang. Steps:
1. headless Service named like the group (the rank pods' subdomain: stable DNS for MASTER_ADDR) and
   the NetworkPolicy of the rank pods (control port from the driver only; resources.network);
2. the gang generation is status.restarts; every rank pod carries its generation; pods of an older
   generation are deleted;
3. a Failed rank pod of the current generation: while restarts < the restart limit, write
   restarts + 1 first (so a crash here cannot lose the count), then the next steps delete the old
   generation; at the limit, condition Failed=True with the rank and its exit reason (the RLJob then
   fails with it) and the pods are deleted to free the GPUs;
   a rank whose pod-template hash differs from a fresh rendering (the spec changed) restarts the gang
   the same way but is not counted: condition UpToDate=False, reason SpecChanged, until every rank
   runs the new template;
4. once no old pod is left, create the missing ranks of the current generation, packed into one
   NVLink domain when the product has them (the clique is picked once and kept in an annotation);
5. status: world size, ready ranks, restarts, conditions.

Who calls it: lockstep_operator.handlers (group events, rank pod events, the periodic re-check).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from lockstep.api.trainergroup import TrainerGroup, TrainerGroupSpec, TrainerGroupStatus
from pydantic import ValidationError

from lockstep_operator.k8s.client import KubeClient, Manifest
from lockstep_operator.reconcile.common import (
    ANN_CLIQUE,
    ANN_CONFIG_HASH,
    ANN_GANG_MIN,
    ANN_RESTART_LIMIT,
    ANN_SHARED_VOLUME,
    ANN_STOPPED,
    ANN_SUSPENDED,
    annotations_of,
    previous_status,
    write_status,
)
from lockstep_operator.reconcile.placement import plan_cliques
from lockstep_operator.reconcile.progress import read_progress
from lockstep_operator.reconcile.status import condition, is_true, trainer_status
from lockstep_operator.resources import podgroups
from lockstep_operator.resources.commands import product_label, trainer_command
from lockstep_operator.resources.common import (
    ANNOTATION_GANG_GENERATION,
    API_VERSION,
    LABEL_RANK,
    Owner,
    engines_service_name,
    pool_name,
    progress_name,
    router_url,
    selector,
)
from lockstep_operator.resources.network import trainer_network_policy
from lockstep_operator.resources.pods import (
    Container,
    Placement,
    rank_pod,
    selector_labels,
    template_hash_of,
    with_template_hash,
)
from lockstep_operator.resources.services import headless_service
from lockstep_operator.settings import OperatorSettings


def gpus_per_pod(spec: TrainerGroupSpec) -> int:
    """GPUs requested by one rank pod (0 for CPU trainers)."""
    return int(spec.trainer.gpus_per_node) if spec.trainer.device.value == "cuda" else 0


def rank_manifest(
    owner: Owner,
    spec: TrainerGroupSpec,
    rank: int,
    *,
    generation: int,
    gang_min: int,
    clique: str | None,
    image: str,
    shared_volume: str | None = None,
    config_hash: str = "",
) -> Manifest:
    """Rank pod `rank` of generation `generation` (pure), annotated with its pod-template hash.

    The hash covers the pod spec, the group's spec and `config_hash` (the run config the ranks read
    from job.yaml, set by the RLJob reconcile); never the generation or gang-membership metadata.
    """
    place = spec.placement
    placement = Placement(
        gpus=gpus_per_pod(spec),
        product=product_label(place.gpu_product.value),
        clique=clique or None,
        node_selector=dict(place.node_selector),
        tolerations=[t.wire() for t in place.tolerations],
    )
    keys = podgroups.member_keys(
        job=spec.job,
        scheduler=place.gang.scheduler.value,
        min_member=gang_min,
        queue=place.gang.queue_name,
        member=True,
    )
    container = Container(
        image=spec.trainer.image or image,
        command=trainer_command(),
        shared_volume_claim=shared_volume or None,
    )
    pod = rank_pod(
        owner,
        job=spec.job,
        trainer=owner.name,
        rank=rank,
        nodes=spec.trainer.nodes,
        generation=generation,
        container=container,
        placement=placement,
        gang=keys,
        router_url=router_url(spec.job),
        engines_service=engines_service_name(pool_name(spec.job)),
    )
    return with_template_hash(pod, {"config": config_hash, "group": spec.wire()})


def _generation(pod: Manifest) -> int:
    return int(((pod["metadata"].get("annotations") or {}).get(ANNOTATION_GANG_GENERATION)) or -1)


def _why(pod: Manifest) -> str:
    """`rank R (pod P) failed: reason (exit N): message` from the pod's container status."""
    rank = pod["metadata"]["labels"].get(LABEL_RANK, "?")
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term and term.get("exitCode", 0) != 0:
            return (
                f"rank {rank} (pod {pod['metadata']['name']}) failed: {term.get('reason', 'Error')} "
                f"(exit {term.get('exitCode')}): {term.get('message', '')}".rstrip(": ")
            )
    return f"rank {rank} (pod {pod['metadata']['name']}) failed"


async def reconcile_trainer(
    kube: KubeClient, namespace: str, name: str, *, settings: OperatorSettings, now: dt.datetime
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
    await kube.apply(headless_service(owner, job=spec.job, name=name, selector=labels), cache=True)
    policy = trainer_network_policy(owner, job=spec.job, trainer=name, pool=pool_name(spec.job))
    await kube.apply(policy, cache=True)
    pods = await kube.list("v1", "Pod", namespace, selector=selector(labels))
    restarts = previous.restarts if previous else 0
    limit = int(ann.get(ANN_RESTART_LIMIT) or settings.gang_restart_limit_default)
    failed_before = (
        condition(previous.conditions, "Failed")
        if previous and is_true(previous.conditions, "Failed")
        else None
    )
    failed = failed_before.message if failed_before else None
    stopped = ann.get(ANN_SUSPENDED) == "true" or bool(ann.get(ANN_STOPPED)) or failed is not None
    expected = {r: template_hash_of(m) for r, m in _rendered(owner, spec, ann, restarts, settings).items()}
    current = [
        p for p in pods if _generation(p) == restarts and template_hash_of(p) == expected.get(_rank(p))
    ]
    stale = [p for p in pods if _generation(p) == restarts and p not in current]
    broken = [p for p in current if not _terminating(p) and (p.get("status") or {}).get("phase") == "Failed"]
    if broken and not stopped:
        if restarts < limit:
            restarts += 1  # written before any deletion: the count survives a crash of this reconcile
            await _write(kube, body, previous, spec, [], restarts, None, now, generation, None)
        else:
            failed, stopped = f"{_why(broken[0])}; gang restart limit {limit} reached", True
    # A spec change (a rank whose pod-template hash differs) restarts the whole gang too, without
    # counting against the limit: every rank is deleted, the new ones start once all are gone.
    rolling = expected.get(0) if stale and not stopped else None
    keep = [] if stopped or any(not _terminating(p) for p in stale) else current
    keep = [p for p in keep if _generation(p) == restarts and not _terminating(p)]
    for pod in pods:
        if pod not in keep and not _terminating(pod):
            await kube.delete("v1", "Pod", namespace, pod["metadata"]["name"])
    if not stopped and len(keep) == len(pods):  # nothing old or terminating left: start the missing ranks
        await _create_missing(kube, owner, spec, body, keep, restarts, settings)
    await _write(kube, body, previous, spec, keep, restarts, failed, now, generation, rolling)


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
            gang_min=int(ann.get(ANN_GANG_MIN, "0") or 0),
            clique=ann.get(ANN_CLIQUE),
            shared_volume=ann.get(ANN_SHARED_VOLUME),
            image=settings.runtime_image,
            config_hash=ann.get(ANN_CONFIG_HASH, ""),
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
    clique = ann.get(ANN_CLIQUE)
    if clique is None:
        clique = await _choose_clique(kube, spec) or ""
        meta = body["metadata"]
        await kube.merge_patch(
            API_VERSION,
            "TrainerGroup",
            meta["namespace"],
            meta["name"],
            {"metadata": {"annotations": {ANN_CLIQUE: clique}}},
        )
    rendered = _rendered(owner, spec, {**ann, ANN_CLIQUE: clique}, restarts, settings)
    for rank in missing:
        await kube.apply(rendered[rank])


async def _choose_clique(kube: KubeClient, spec: TrainerGroupSpec) -> str | None:
    """For a TrainerGroup created without the job's placement plan: pick a clique now."""
    clique, _ = await plan_cliques(
        kube,
        product=product_label(spec.placement.gpu_product.value),
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
    restarts: int,
    failed: str | None,
    now: dt.datetime,
    generation: Any,
    rolling: str | None,
) -> None:
    progress, _ = read_progress(
        await kube.get("v1", "ConfigMap", body["metadata"]["namespace"], progress_name(spec.job))
    )
    status = trainer_status(
        live,
        nodes=spec.trainer.nodes,
        gpus_per_node=spec.trainer.gpus_per_node,
        restarts=restarts,
        failed=failed,
        previous=previous,
        step=progress.step if progress else None,
        rolling=rolling,
        generation=generation,
        now=now,
    )
    if await write_status(kube, body, previous, status):
        body["status"] = status.wire()
