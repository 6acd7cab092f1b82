"""Trainer rank pods of a TrainerGroup, rendered from the group's spec and the job's annotations.

Why it exists: the TrainerGroup reconcile compares every rank with a fresh rendering (the pod-template
hash over the pod spec, the group's spec and the run config) to detect a spec change, which restarts
the gang; rendering is pure and lives with the other builders. Called by the TrainerGroup reconcile.
"""

from __future__ import annotations

from lockstep.api.trainergroup import TrainerGroupSpec

from lockstep_operator.resources import podgroups
from lockstep_operator.resources.commands import trainer_command
from lockstep_operator.resources.common import (
    LABEL_JOB,
    LABEL_POOL,
    LABEL_ROLE,
    Manifest,
    Owner,
    engines_service_name,
    pool_router_url,
    used_pool,
)
from lockstep_operator.resources.local_disk import local_disk_volume
from lockstep_operator.resources.model import model_pull
from lockstep_operator.resources.platforms import NodeFacts, default_facts
from lockstep_operator.resources.pods import (
    Container,
    Placement,
    rank_pod,
    with_architectures,
    with_template_hash,
)

GPU_SHM = "32Gi"
"""/dev/shm of a GPU rank pod (NCCL's shared-memory transport between the node's GPUs)."""


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
    p2p_rdma: str | None = None,
    facts: NodeFacts | None = None,
    shared_pool: str | None = None,
) -> Manifest:
    """Rank pod `rank` of generation `generation` (pure), annotated with its pod-template hash.

    The hash covers the pod spec, the group's spec and `config_hash` (the run config the ranks read
    from job.yaml, set by the RLJob reconcile); never the generation or gang-membership metadata.
    GPU ranks get a memory-backed /dev/shm (NCCL); `p2p_rdma` (the job's transport is p2p) names the
    RDMA resource each rank requests one of, with IPC_LOCK to pin its registered buffers.
    `shared_pool`: the standalone RolloutPool the job uses (rollout.poolRef), whose engines it updates. `facts`
    (the operator settings' GPU product labels and image architectures) place it.
    """
    facts = facts or default_facts()
    place = spec.placement
    placement = Placement(
        gpus=gpus_per_pod(spec),
        product=facts.product_label(place.gpu_product.value),
        clique=clique or None,
        node_selector=dict(place.node_selector),
        tolerations=[t.wire() for t in place.tolerations],
        extra_resources={p2p_rdma: "1"} if p2p_rdma else {},
        # The engines it updates and its other ranks (resources.pods.network_affinity).
        near=(
            {LABEL_POOL: used_pool(spec.job, shared_pool), LABEL_ROLE: "engine"},
            {LABEL_JOB: spec.job, LABEL_ROLE: "trainer"},
        ),
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
        shm_size=GPU_SHM if gpus_per_pod(spec) else None,
        capabilities=("IPC_LOCK",) if p2p_rdma else (),
        model=model_pull(spec.model, image),
    )
    placement = with_architectures(placement, container, facts)
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
        router_url=pool_router_url(used_pool(spec.job, shared_pool)),
        engines_service=engines_service_name(used_pool(spec.job, shared_pool)),
        shared_pool=shared_pool,
        grace_seconds=spec.preemption_grace_seconds,
    )
    if spec.trainer.local_disk is not None:  # offload: disk and the streamed optimizer state
        volume, mount = local_disk_volume(spec.trainer.local_disk)
        pod["spec"]["volumes"].append(volume)
        pod["spec"]["containers"][0]["volumeMounts"].append(mount)
    return with_template_hash(pod, {"config": config_hash, "group": spec.wire()})
