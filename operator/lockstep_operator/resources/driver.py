"""The driver pod of an RLJob, rendered from the job's spec.

Why it exists: the RLJob reconcile replaces the driver when its pod-template hash (the pod spec plus
the run config hash) differs from a fresh rendering; rendering is pure and lives with the other
builders. Called by the RLJob reconcile; golden-tested.
"""

from __future__ import annotations

import json

from lockstep.api.rljob import (
    TEACHER_URLS_ENV,
    RLJobSpec,
    standalone_teachers,
    teacher_api_key_env,
    teacher_pool_name,
)

from lockstep_operator.resources.children import run_config_hash
from lockstep_operator.resources.commands import driver_command
from lockstep_operator.resources.common import (
    API_KEY_ITEM,
    Manifest,
    Owner,
    api_key_secret_name,
    engines_service_name,
    pool_router_url,
    progress_name,
    teacher_client_label,
    trainer_name,
    trainer_url,
    used_pool,
)
from lockstep_operator.resources.model import model_pull
from lockstep_operator.resources.platforms import NodeFacts, default_facts
from lockstep_operator.resources.pods import (
    Container,
    Placement,
    driver_pod,
    with_architectures,
    with_template_hash,
)
from lockstep_operator.resources.sandbox import POD_UID_ENV, WARMPOOL_ENV, sandbox_name


def driver_manifest(owner: Owner, spec: RLJobSpec, *, image: str, facts: NodeFacts | None = None) -> Manifest:
    """The driver pod of the job (pure); `image` is used when spec.agent.image names none. It follows
    the job's placement (node selector, tolerations) and mounts the job's shared claim, if any.

    Annotated with its pod-template hash over the pod spec and the run config (run_config_hash).
    """
    job = owner.name
    facts = facts or default_facts()
    shared = spec.rollout.pool_ref.name if spec.rollout.pool_ref else None
    pool = used_pool(job, shared)
    container = Container(
        image=spec.agent.image or image,
        command=driver_command(),
        model=model_pull(spec.model, image),
        shared_volume_claim=spec.weight_sync.disk_delta.volume_claim,
    )
    placement = Placement(
        node_selector=dict(spec.placement.node_selector),
        tolerations=[t.wire() for t in spec.placement.tolerations],
    )
    pod = driver_pod(
        owner,
        job=job,
        container=container,
        router_url=pool_router_url(pool),
        trainer=trainer_name(job),
        trainer_url=trainer_url(trainer_name(job), owner.namespace),
        progress_config_map=progress_name(job),
        engines_service=engines_service_name(pool),
        shared_pool=shared,
        grace_seconds=spec.schedule.preemption_grace_seconds,
        placement=with_architectures(placement, container, facts),
    )
    if spec.agent.sandbox is not None:  # episodes claim sandboxes from the job's warm pool
        pod["spec"]["containers"][0]["env"].extend(
            [
                {"name": WARMPOOL_ENV, "value": sandbox_name(job)},
                # the claims' owner: a replaced driver pod takes its claims with it
                {"name": POD_UID_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
            ]
        )
    teachers = teacher_urls(spec, job)
    if teachers:  # on-policy distillation: where each teacher's engines serve (lockstep.driver.opd)
        pod["spec"]["containers"][0]["env"].append({"name": TEACHER_URLS_ENV, "value": json.dumps(teachers)})
    for teacher, teacher_pool in standalone_teachers(spec).items():
        # the pool's own key opens its engines, its NetworkPolicy admits the label
        ref = {"name": api_key_secret_name(teacher_pool), "key": API_KEY_ITEM}
        env = {"name": teacher_api_key_env(teacher), "valueFrom": {"secretKeyRef": ref}}
        pod["spec"]["containers"][0]["env"].append(env)
        pod["metadata"]["labels"][teacher_client_label(teacher_pool)] = "true"
    return with_template_hash(pod, {"config": run_config_hash(spec)})


def teacher_urls(spec: RLJobSpec, job: str) -> dict[str, str]:
    """Teacher name -> the router URL of the pool serving it, for checkpoint teachers (the job's teacher
    pools) and poolRef teachers (standalone pools); url teachers are reached at their own URL (pure)."""
    opd = spec.algorithm.opd
    out: dict[str, str] = {}
    for teacher in opd.teachers if opd is not None else []:
        if teacher.checkpoint is not None:
            out[teacher.name] = pool_router_url(teacher_pool_name(job, teacher.name))
        elif teacher.pool_ref is not None:
            out[teacher.name] = pool_router_url(teacher.pool_ref.name)
    return out
