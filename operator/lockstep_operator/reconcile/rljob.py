"""RLJob reconcile: the job's config, progress channel, gang, child kinds and driver pod, then status.

Why it exists: an RLJob is the user's whole request; this turns it into owned children and folds
what they and the driver report back into one status. Ordered, idempotent steps (server-side apply,
deterministic names), so a reconcile killed halfway and run again creates no duplicates:
1. parse the spec (a bad spec fails the job with the validation message);
2. ConfigMaps (job.yaml, the channel's transport choice, the empty progress channel), driver RBAC,
   the driver's NetworkPolicy, the job's API-key Secret (created once, never re-applied);
3. gang: the scheduler's API must be served (else Admitted=False and stop), apply the PodGroup;
4. RolloutPool, TrainerGroup, WeightChannel (resources.children); the pool is created with
   spec.replicas and later only re-applied without it, so /scale keeps control;
5. the driver pod (deleted while suspended; replaced when its pod-template hash changed);
6. observe children + progress, compute the status (status.job_status), write it once if changed.
Who calls it: lockstep_operator.handlers, for kopf events of the RLJob and of its children.
"""

from __future__ import annotations

import asyncio
import datetime as dt

from lockstep.api.rljob import Phase, RLJob, RLJobSpec, RLJobStatus
from lockstep.api.rolloutpool import RolloutPoolStatus
from lockstep.api.trainergroup import TrainerGroupStatus
from lockstep.api.weightchannel import WeightChannelStatus
from pydantic import ValidationError

from lockstep_operator.k8s.client import ApiError, KubeClient, Manifest
from lockstep_operator.policy.condition import set_condition
from lockstep_operator.policy.driver_stop import delete_driver
from lockstep_operator.policy.job_observed import init_failure
from lockstep_operator.reconcile.common import annotations_of, previous_status, write_status
from lockstep_operator.reconcile.placement import plan_cliques
from lockstep_operator.reconcile.progress import read_progress, read_rank_reports
from lockstep_operator.reconcile.status import JobObserved, job_status
from lockstep_operator.resources import config, podgroups, secrets
from lockstep_operator.resources.annotations import Annotation
from lockstep_operator.resources.children import child_manifests
from lockstep_operator.resources.commands import product_label
from lockstep_operator.resources.common import (
    API_VERSION,
    Owner,
    channel_name,
    driver_name,
    pool_name,
    progress_name,
    selector,
    trainer_name,
)
from lockstep_operator.resources.driver import driver_manifest
from lockstep_operator.resources.model import local_model
from lockstep_operator.resources.network import driver_network_policy
from lockstep_operator.resources.pods import selector_labels, template_hash_of
from lockstep_operator.settings import FIELD_MANAGER, OperatorSettings

CREATE_FIELD_MANAGER = f"{FIELD_MANAGER}-create"
"""Field manager of the pool's create: it owns spec.replicas, which later applies leave to /scale."""


async def reconcile_job(
    kube: KubeClient, namespace: str, name: str, *, settings: OperatorSettings, now: dt.datetime
) -> Phase | None:
    """One pass over RLJob `namespace/name`; returns the phase written (None when gone or deleting)."""
    body = await kube.get(API_VERSION, "RLJob", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    generation = body["metadata"].get("generation")
    previous = previous_status(body, RLJobStatus)
    try:
        job = RLJob.model_validate(body)
    except ValidationError as err:
        return await _invalid(kube, body, previous, str(err), generation, now)
    spec, owner = job.spec, Owner.of(body)
    channel = await kube.get(API_VERSION, "WeightChannel", namespace, channel_name(name))
    choice = config.transport_choice(previous_status(channel, WeightChannelStatus) if channel else None)
    rendered = {
        "apiVersion": API_VERSION,
        "kind": "RLJob",
        "metadata": {"name": name, "namespace": namespace},
        # hub references read as the model volume's directories (resources.model)
        "spec": spec.model_copy(update={"model": local_model(spec.model)}).wire(),
    }
    manifests = [
        config.runtime_config_map(owner, job=name, rendered=rendered, transport=choice),
        config.progress_config_map(owner, job=name),
        *config.driver_rbac(owner, job=name),
        driver_network_policy(owner, job=name),
        *config.trainer_rbac(owner, job=name),
    ]
    await asyncio.gather(*(kube.apply(m, cache=True) for m in manifests), _ensure_api_key(kube, owner))
    gang_problem = await _ensure_gang(kube, owner, spec)
    terminal = previous is not None and previous.phase in (Phase.SUCCEEDED, Phase.FAILED)
    if gang_problem is None:
        stopped = previous.phase.value if terminal and previous and previous.phase else ""
        await _apply_children(kube, owner, spec, suspended=spec.suspend, stopped=stopped)
        await _ensure_driver(
            kube, owner, spec, settings, run=not spec.suspend and not terminal, previous=previous, now=now
        )
    observed = await _observe(kube, namespace, name, gang_problem, channel)
    status = job_status(spec, observed, previous, generation=generation, now=now)
    await write_status(kube, body, previous, status)
    return status.phase


_KEYED: set[str] = set()
"""UIDs of jobs whose API-key Secret this process created or found (no create call per pass)."""


async def _ensure_api_key(kube: KubeClient, owner: Owner) -> None:
    """Create Secret `<job>-api-key` once. Create, never apply: an apply would rotate the key under
    running pods. The operator needs only `create` on secrets (a 409 means it exists); it never
    reads a Secret back, and the key appears in no log."""
    if owner.uid in _KEYED:
        return
    try:
        await kube.create(secrets.api_key_secret(owner, job=owner.name, key=secrets.new_api_key()))
    except ApiError as err:
        if err.status != 409:
            raise
    _KEYED.add(owner.uid)


async def _invalid(
    kube: KubeClient,
    body: Manifest,
    previous: RLJobStatus | None,
    problem: str,
    generation: int | None,
    now: dt.datetime,
) -> Phase:
    prev = previous or RLJobStatus()
    conds = set_condition(
        prev.conditions, "Failed", True, "InvalidSpec", problem[:2000], now=now, generation=generation
    )
    status = prev.model_copy(
        update={"phase": Phase.FAILED, "conditions": conds, "observed_generation": generation}
    )
    await write_status(kube, body, previous, status)
    return Phase.FAILED


async def _ensure_gang(kube: KubeClient, owner: Owner, spec: RLJobSpec) -> str | None:
    """Apply the pod group; a scheduler whose API is not served is a problem string, never a crash."""
    # The API enum's values are exactly podgroups.Scheduler's literals.
    scheduler: podgroups.Scheduler = spec.placement.gang.scheduler.value
    api = podgroups.group_api(scheduler)
    if api is None:
        return None
    if not await kube.has_api(*api):
        return (
            f"placement.gang.scheduler is {scheduler} but {api[1]} ({api[0]}) is not served by the cluster: "
            f"install {scheduler} or set placement.gang.scheduler: none"
        )
    if scheduler == "kueue" and not spec.placement.gang.queue_name:
        return "placement.gang.scheduler is kueue but placement.gang.queueName is empty: name the LocalQueue"
    group = podgroups.pod_group(
        owner,
        job=owner.name,
        scheduler=scheduler,
        min_member=podgroups.gang_min_member(spec),
        queue=spec.placement.gang.queue_name,
    )
    if group is not None:
        await kube.apply(group, cache=True)
    return None


async def _apply_children(
    kube: KubeClient, owner: Owner, spec: RLJobSpec, *, suspended: bool, stopped: str
) -> None:
    clique, avoid = await _placement_plan(kube, owner, spec)
    pool, trainer, channel = child_manifests(
        owner, spec, suspended=suspended, stopped=stopped, clique=clique, avoid_clique=avoid
    )
    existing = await kube.get(API_VERSION, "RolloutPool", owner.namespace, pool["metadata"]["name"])
    if existing is None:
        # Created with replicas by a create (an Update operation of its own field manager): later
        # applies leave replicas to /scale.
        pool["spec"]["replicas"] = spec.rollout.replicas
        await kube.create(pool, field_manager=CREATE_FIELD_MANAGER)
    else:
        if annotations_of(existing).get(Annotation.JOB_REPLICAS) != str(spec.rollout.replicas):
            # The user changed rollout.replicas on the job: that wins over the pool's current count.
            patch = {"spec": {"replicas": spec.rollout.replicas}}
            await kube.merge_patch(API_VERSION, "RolloutPool", owner.namespace, pool_name(owner.name), patch)
        await kube.apply(pool, cache=True)
    await asyncio.gather(kube.apply(trainer, cache=True), kube.apply(channel, cache=True))


async def _placement_plan(kube: KubeClient, owner: Owner, spec: RLJobSpec) -> tuple[str, str]:
    """The NVLink placement decided once: read back from the children, else planned now."""
    trainer, pool = await asyncio.gather(
        kube.get(API_VERSION, "TrainerGroup", owner.namespace, trainer_name(owner.name)),
        kube.get(API_VERSION, "RolloutPool", owner.namespace, pool_name(owner.name)),
    )
    if trainer is not None and Annotation.CLIQUE in annotations_of(trainer):
        avoid = annotations_of(pool).get(Annotation.AVOID_CLIQUE, "") if pool else ""
        return annotations_of(trainer)[Annotation.CLIQUE], avoid
    gpus_per_rank = spec.trainer.gpus_per_node if spec.trainer.device.value == "cuda" else 0
    return await plan_cliques(
        kube,
        product=product_label(spec.placement.gpu_product.value),
        ranks=spec.trainer.nodes,
        gpus_per_rank=gpus_per_rank,
        engines=spec.rollout.replicas,
        gpus_per_engine=spec.rollout.gpus_per_engine,
    )


async def _ensure_driver(
    kube: KubeClient,
    owner: Owner,
    spec: RLJobSpec,
    settings: OperatorSettings,
    *,
    run: bool,
    previous: RLJobStatus | None = None,
    now: dt.datetime | None = None,
) -> None:
    job = owner.name
    if not run:
        existing = await kube.get("v1", "Pod", owner.namespace, driver_name(job))
        phase = existing.get("status", {}).get("phase") if existing is not None else None
        ended = previous.completion_time if previous is not None else None
        completed_for = (now - ended).total_seconds() if ended is not None and now is not None else None
        if existing is not None and delete_driver(previous.phase if previous else None, phase, completed_for):
            await kube.delete("v1", "Pod", owner.namespace, driver_name(job))
        return
    pod = driver_manifest(owner, spec, image=settings.runtime_image)
    existing = await kube.get("v1", "Pod", owner.namespace, driver_name(job))
    if existing is None:
        await kube.apply(pod)
    elif template_hash_of(existing) != template_hash_of(pod) and not existing["metadata"].get(
        "deletionTimestamp"
    ):
        # Pod specs are immutable: a changed spec replaces the driver (it resumes from its last
        # checkpoint); the next pass creates the new one once the old pod is gone.
        await kube.delete("v1", "Pod", owner.namespace, driver_name(job))


async def _observe(
    kube: KubeClient, namespace: str, job: str, gang_problem: str | None, channel: Manifest | None
) -> JobObserved:
    """The children and the progress channel. `channel` is the WeightChannel read before the config
    ConfigMap was applied: status.transport on the job then always matches its transport.json."""
    pool, trainer, progress_cm, driver, engines = await asyncio.gather(
        kube.get(API_VERSION, "RolloutPool", namespace, pool_name(job)),
        kube.get(API_VERSION, "TrainerGroup", namespace, trainer_name(job)),
        kube.get("v1", "ConfigMap", namespace, progress_name(job)),
        kube.get("v1", "Pod", namespace, driver_name(job)),
        kube.list("v1", "Pod", namespace, selector=selector(selector_labels(job, pool=pool_name(job)))),
    )
    engine_failures = (
        f"{p['metadata']['name']}: {failure}"
        for p in sorted(engines, key=lambda p: str(p["metadata"]["name"]))
        if (failure := init_failure(p)) is not None
    )
    progress, problem = read_progress(progress_cm)
    return JobObserved(
        pool=previous_status(pool, RolloutPoolStatus) if pool else None,
        trainer=previous_status(trainer, TrainerGroupStatus) if trainer else None,
        channel=previous_status(channel, WeightChannelStatus) if channel else None,
        progress=progress,
        progress_problem=problem,
        driver_phase=(driver.get("status") or {}).get("phase") if driver else None,
        gang_problem=gang_problem,
        rank_reports=read_rank_reports(progress_cm),
        driver_init_failure=init_failure(driver),
        engine_init_failure=next(engine_failures, None),
    )
