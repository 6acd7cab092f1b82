"""The driver pod of an RLJob, rendered from the job's spec.

Why it exists: the RLJob reconcile replaces the driver when its pod-template hash (the pod spec plus
the run config hash) differs from a fresh rendering; rendering is pure and lives with the other
builders. Called by the RLJob reconcile; golden-tested.
"""

from __future__ import annotations

from lockstep.api.rljob import RLJobSpec

from lockstep_operator.resources.children import run_config_hash
from lockstep_operator.resources.commands import driver_command
from lockstep_operator.resources.common import (
    Manifest,
    Owner,
    engines_service_name,
    pool_name,
    progress_name,
    router_url,
    trainer_name,
    trainer_url,
)
from lockstep_operator.resources.model import model_pull
from lockstep_operator.resources.pods import Container, Placement, driver_pod, with_template_hash


def driver_manifest(owner: Owner, spec: RLJobSpec, *, image: str) -> Manifest:
    """The driver pod of the job (pure); `image` is used when spec.agent.image names none. It follows
    the job's placement (node selector, tolerations) and mounts the job's shared claim, if any.

    Annotated with its pod-template hash over the pod spec and the run config (run_config_hash).
    """
    job = owner.name
    pod = driver_pod(
        owner,
        job=job,
        container=Container(
            image=spec.agent.image or image,
            command=driver_command(),
            model=model_pull(spec.model, image),
            shared_volume_claim=spec.weight_sync.disk_delta.volume_claim,
        ),
        router_url=router_url(job),
        trainer=trainer_name(job),
        trainer_url=trainer_url(trainer_name(job), owner.namespace),
        progress_config_map=progress_name(job),
        engines_service=engines_service_name(pool_name(job)),
        placement=Placement(
            node_selector=dict(spec.placement.node_selector),
            tolerations=[t.wire() for t in spec.placement.tolerations],
        ),
    )
    return with_template_hash(pod, {"config": run_config_hash(spec)})
