"""Trainer rank pods of a TrainerGroup, rendered from the group's spec and the job's annotations.

Why it exists: the TrainerGroup reconcile compares every rank with a fresh rendering (the pod-template
hash over the pod spec, the group's spec and the run config) to detect a spec change, which restarts
the gang; rendering is pure and lives with the other builders. Called by the TrainerGroup reconcile.
"""

from __future__ import annotations

from lockstep.api.trainergroup import TrainerGroupSpec

from lockstep_operator.resources import podgroups
from lockstep_operator.resources.commands import product_label, trainer_command
from lockstep_operator.resources.common import Manifest, Owner, engines_service_name, pool_name, router_url
from lockstep_operator.resources.model import model_pull
from lockstep_operator.resources.pods import Container, Placement, rank_pod, with_template_hash

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
) -> Manifest:
    """Rank pod `rank` of generation `generation` (pure), annotated with its pod-template hash.

    The hash covers the pod spec, the group's spec and `config_hash` (the run config the ranks read
    from job.yaml, set by the RLJob reconcile); never the generation or gang-membership metadata.
    GPU ranks get a memory-backed /dev/shm (NCCL); `p2p_rdma` (the job's transport is p2p) names the
    RDMA resource each rank requests one of, with IPC_LOCK to pin its registered buffers.
    """
    place = spec.placement
    placement = Placement(
        gpus=gpus_per_pod(spec),
        product=product_label(place.gpu_product.value),
        clique=clique or None,
        node_selector=dict(place.node_selector),
        tolerations=[t.wire() for t in place.tolerations],
        extra_resources={p2p_rdma: "1"} if p2p_rdma else {},
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
