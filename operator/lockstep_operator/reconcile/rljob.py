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
6. observe children + progress, compute the status (status.job_status), write it once if changed;
   the Events the transition tells (policy.events.job_events) go to the pass's recorder.
Who calls it: lockstep_operator.handlers, for kopf events of the RLJob and of its children.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt

from lockstep.api.rljob import (
    Phase,
    RLJob,
    RLJobSpec,
    RLJobStatus,
    TrainingRecipe,
    standalone_teachers,
    teacher_pool_name,
)
from lockstep.api.rolloutpool import RolloutPool, RolloutPoolStatus
from lockstep.api.trainergroup import TrainerGroupStatus
from lockstep.api.weightchannel import WeightChannelStatus
from pydantic import ValidationError

from lockstep_operator.k8s.client import ApiError, KubeClient, Manifest
from lockstep_operator.k8s.events import Recorder
from lockstep_operator.policy.condition import set_condition
from lockstep_operator.policy.driver_stop import delete_driver
from lockstep_operator.policy.events import Reason, job_events, normal
from lockstep_operator.policy.job_observed import init_failure, main_restarts
from lockstep_operator.policy.pool_ref import PoolRefProblem, PoolUser, pool_ref_problem
from lockstep_operator.policy.teacher_pools import teacher_pool_problem
from lockstep_operator.reconcile.common import (
    annotations_of,
    ensure_api_key,
    ensure_baseline,
    previous_status,
    write_status,
)
from lockstep_operator.reconcile.placement import plan_cliques
from lockstep_operator.reconcile.progress import read_progress, read_rank_reports
from lockstep_operator.reconcile.status import JobObserved, job_status
from lockstep_operator.resources import config, podgroups
from lockstep_operator.resources.adapter_gc import unload_labels
from lockstep_operator.resources.annotations import Annotation
from lockstep_operator.resources.children import child_manifests, teacher_pool_manifests
from lockstep_operator.resources.colocation import colocation_problem
from lockstep_operator.resources.common import (
    API_VERSION,
    LABEL_POOL,
    LABEL_ROLE,
    Owner,
    channel_name,
    driver_name,
    pool_name,
    progress_name,
    selector,
    trainer_name,
    used_pool,
)
from lockstep_operator.resources.driver import driver_manifest
from lockstep_operator.resources.model import local_model
from lockstep_operator.resources.network import driver_network_policy
from lockstep_operator.resources.platforms import NodeFacts
from lockstep_operator.resources.pods import template_hash_of
from lockstep_operator.resources.sandbox import sandbox_manifests
from lockstep_operator.settings import FIELD_MANAGER, OperatorSettings

CREATE_FIELD_MANAGER = f"{FIELD_MANAGER}-create"
"""Field manager of the pool's create: it owns spec.replicas, which later applies leave to /scale."""


async def reconcile_job(
    kube: KubeClient,
    namespace: str,
    name: str,
    *,
    settings: OperatorSettings,
    now: dt.datetime,
    recorder: Recorder | None = None,
) -> Phase | None:
    """One pass over RLJob `namespace/name`; returns the phase written (None when gone or deleting)."""
    body = await kube.get(API_VERSION, "RLJob", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    generation = body["metadata"].get("generation")
    previous = previous_status(body, RLJobStatus)
    recorder = recorder or Recorder(None)
    try:
        job = RLJob.model_validate(body)
    except ValidationError as err:
        return await _invalid(kube, body, previous, str(err), generation, now, recorder)
    spec, owner = job.spec, Owner.of(body)
    channel = await kube.get(API_VERSION, "WeightChannel", namespace, channel_name(name))
    agent = bool(spec.agent.agent_function or spec.agent.sandbox)  # its driver routes agent sessions
    rbac = [
        *config.driver_rbac(owner, job=name),
        *config.trainer_rbac(owner, job=name),
        *config.session_routing_rbac(owner, job=name, agent=agent),
    ]
    accounts = [m for m in rbac if m["kind"] == "ServiceAccount"]
    # The pods first (what a user waits for): their ServiceAccounts, which admission requires, then
    # the children and the driver, then what the pods need only once they run (config, RBAC, policy,
    # key), all in this pass (docs/operator.md, "Reconcile order").
    await asyncio.gather(
        *(kube.create_or_apply(m, cache=True) for m in accounts), ensure_baseline(kube, namespace)
    )
    colocation = colocation_problem(spec)  # GPU colocation cannot be rendered: refused with the reason
    if colocation is not None:
        return await _invalid(kube, body, previous, colocation, generation, now, recorder)
    created = str(body["metadata"].get("creationTimestamp") or "")
    started = previous is not None and previous.phase not in (None, Phase.PENDING)
    pool_ref = await _check_pool_ref(kube, namespace, spec, name, created, started=started)
    teacher_problem, teacher_invalid = await _check_teacher_pools(kube, namespace, spec)
    if pool_ref.invalid is not None or teacher_invalid is not None:
        invalid = pool_ref.invalid or teacher_invalid or ""
        return await _invalid(kube, body, previous, invalid, generation, now, recorder)
    missing_pool = pool_ref.waiting or teacher_problem  # nothing of the job is created until it exists
    gang_problem = None if missing_pool else await _ensure_gang(kube, owner, spec)
    terminal = previous is not None and previous.phase in (Phase.SUCCEEDED, Phase.FAILED)
    if gang_problem is None and missing_pool is None:
        stopped = previous.phase.value if terminal and previous and previous.phase else ""
        run = not spec.suspend and not terminal
        _, replaced = await asyncio.gather(
            _apply_children(
                kube, owner, spec, suspended=spec.suspend, stopped=stopped, facts=settings.node_facts()
            ),
            _ensure_driver(kube, owner, spec, settings, run=run, previous=previous, now=now),
        )
        if replaced:
            message = "the driver's pod spec changed: replacing it"
            recorder.record(body, normal(Reason.DRIVER_REPLACED, message))
    choice = config.transport_choice(previous_status(channel, WeightChannelStatus) if channel else None)
    rendered = {
        "apiVersion": API_VERSION,
        "kind": "RLJob",
        "metadata": {"name": name, "namespace": namespace},
        # hub references read as the model volume's directories (resources.model)
        "spec": spec.model_copy(update={"model": local_model(spec.model)}).wire(),
    }
    # Rendered only now: job.yaml's first rendering of a job costs milliseconds of the loop, which a
    # burst of new jobs would otherwise spend before any of their pods.
    manifests = [
        config.runtime_config_map(owner, job=name, rendered=rendered, transport=choice),
        config.progress_config_map(
            owner, job=name, pool=spec.rollout.pool_ref.name if spec.rollout.pool_ref else None
        ),
        *(m for m in rbac if m["kind"] != "ServiceAccount"),
        driver_network_policy(owner, job=name),
        *sandbox_manifests(owner, spec),  # a job with spec.agent.sandbox: template, warm pool, claim Role
    ]
    await asyncio.gather(*(kube.apply(m, cache=True) for m in manifests), _ensure_api_key(kube, owner))
    shared = spec.rollout.pool_ref.name if spec.rollout.pool_ref else None
    teachers = [teacher_pool_name(name, t.name) for t in spec.algorithm.opd.teachers if t.checkpoint] if (
        spec.algorithm.opd is not None
    ) else []  # fmt: skip
    teachers += sorted(set(standalone_teachers(spec).values()))  # the standalone teacher pools it reads
    observed = await _observe(kube, namespace, name, gang_problem, channel, used_pool(name, shared), teachers)
    reason = pool_ref.reason if pool_ref.waiting else "PoolNotFound"  # a teacher's pool: only missing
    observed = dataclasses.replace(observed, missing_pool=missing_pool, missing_pool_reason=reason)
    status = job_status(spec, observed, previous, generation=generation, now=now)
    if await write_status(kube, body, previous, status):
        recorder.record(body, *job_events(previous, status))
    return status.phase


async def _ensure_api_key(kube: KubeClient, owner: Owner) -> None:
    await ensure_api_key(kube, owner, owner.name)


async def _invalid(
    kube: KubeClient,
    body: Manifest,
    previous: RLJobStatus | None,
    problem: str,
    generation: int | None,
    now: dt.datetime,
    recorder: Recorder,
) -> Phase:
    prev = previous or RLJobStatus()
    conds = set_condition(
        prev.conditions, "Failed", True, "InvalidSpec", problem[:2000], now=now, generation=generation
    )
    status = prev.model_copy(
        update={"phase": Phase.FAILED, "conditions": conds, "observed_generation": generation}
    )
    if await write_status(kube, body, previous, status):
        recorder.record(body, *job_events(previous, status))
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
    kube: KubeClient, owner: Owner, spec: RLJobSpec, *, suspended: bool, stopped: str, facts: NodeFacts
) -> None:
    clique, avoid = await _placement_plan(kube, owner, spec, facts)
    pool, trainer, channel = child_manifests(
        owner, spec, suspended=suspended, stopped=stopped, clique=clique, avoid_clique=avoid
    )
    teachers = teacher_pool_manifests(owner, spec, suspended=suspended, stopped=stopped)
    await asyncio.gather(*(_apply_pool(kube, owner, t) for t in teachers))
    if spec.recipe is TrainingRecipe.SFT:  # no engines: no RolloutPool, no WeightChannel
        await kube.apply(trainer, cache=True)
        return
    if spec.rollout.pool_ref is not None:  # a standalone pool: its own, never created nor scaled by a job
        await asyncio.gather(kube.apply(trainer, cache=True), kube.apply(channel, cache=True))
        return
    existing = await kube.get(API_VERSION, "RolloutPool", owner.namespace, pool["metadata"]["name"])
    if existing is None:
        # Created with replicas by a create (an Update operation of its own field manager): later
        # applies leave replicas to /scale.
        applied = {**pool, "spec": dict(pool["spec"])}  # what later passes apply (without replicas)
        pool["spec"]["replicas"] = spec.rollout.replicas
        try:
            await kube.create(pool, field_manager=CREATE_FIELD_MANAGER)
            kube.remember(applied)
        except ApiError as err:
            if err.status != 409:  # 409: another replica (or a pass the cache had not seen yet) made it
                raise
    else:
        if annotations_of(existing).get(Annotation.JOB_REPLICAS) != str(spec.rollout.replicas):
            # The user changed rollout.replicas on the job: that wins over the pool's current count.
            patch = {"spec": {"replicas": spec.rollout.replicas}}
            await kube.merge_patch(API_VERSION, "RolloutPool", owner.namespace, pool_name(owner.name), patch)
        await kube.apply(pool, cache=True)
    await asyncio.gather(kube.apply(trainer, cache=True), kube.apply(channel, cache=True))


async def _apply_pool(kube: KubeClient, owner: Owner, pool: Manifest) -> None:
    """Create a teacher pool with its replicas (then /scale owns them), or re-apply it without."""
    name = pool["metadata"]["name"]
    replicas = int(pool["metadata"]["annotations"][Annotation.JOB_REPLICAS.value])
    existing = await kube.get(API_VERSION, "RolloutPool", owner.namespace, name)
    if existing is None:  # as the job's own pool: created with replicas, later applies leave them to /scale
        try:
            await kube.create(
                {**pool, "spec": {**pool["spec"], "replicas": replicas}}, field_manager=CREATE_FIELD_MANAGER
            )
            kube.remember(pool)
        except ApiError as err:
            if err.status != 409:
                raise
        return
    if annotations_of(existing).get(Annotation.JOB_REPLICAS) != str(replicas):
        await kube.merge_patch(
            API_VERSION, "RolloutPool", owner.namespace, name, {"spec": {"replicas": replicas}}
        )
    await kube.apply(pool, cache=True)


async def _placement_plan(
    kube: KubeClient, owner: Owner, spec: RLJobSpec, facts: NodeFacts
) -> tuple[str, str]:
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
        product=facts.product_label(spec.placement.gpu_product.value),
        ranks=spec.trainer.nodes,
        gpus_per_rank=gpus_per_rank,
        engines=0
        if spec.rollout.pool_ref is not None or spec.recipe is TrainingRecipe.SFT
        else spec.rollout.replicas,
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
) -> bool:
    """Create, replace (its template changed: returns True) or stop the driver pod."""
    job = owner.name
    if not run:
        existing = await kube.get("v1", "Pod", owner.namespace, driver_name(job))
        phase = existing.get("status", {}).get("phase") if existing is not None else None
        ended = previous.completion_time if previous is not None else None
        completed_for = (now - ended).total_seconds() if ended is not None and now is not None else None
        if existing is not None and delete_driver(previous.phase if previous else None, phase, completed_for):
            await kube.delete("v1", "Pod", owner.namespace, driver_name(job))
        return False
    pod = driver_manifest(owner, spec, image=settings.runtime_image, facts=settings.node_facts())
    existing = await kube.get("v1", "Pod", owner.namespace, driver_name(job))
    if existing is None:
        await kube.create_or_apply(pod)
    elif template_hash_of(existing) != template_hash_of(pod) and not existing["metadata"].get(
        "deletionTimestamp"
    ):
        # Pod specs are immutable: a changed spec replaces the driver (it resumes from its last
        # checkpoint); the next pass creates the new one once the old pod is gone.
        await kube.delete("v1", "Pod", owner.namespace, driver_name(job))
        return True
    return False


async def _check_pool_ref(
    kube: KubeClient, namespace: str, spec: RLJobSpec, job: str, created: str, *, started: bool
) -> PoolRefProblem:
    """The job's problem with the standalone pool its rollout.poolRef names (policy.pool_ref). Until
    it has started, the pool's unload pods count too (a predecessor of its adapter name)."""
    ref = spec.rollout.pool_ref
    if ref is None:
        return PoolRefProblem()
    unloading: dict[str, str] = {}
    if not started:
        for pod in await kube.list("v1", "Pod", namespace, selector=selector(unload_labels(ref.name))):
            adapter = (pod["metadata"].get("annotations") or {}).get(Annotation.ADAPTER.value)
            if adapter:
                unloading[str(adapter)] = pod["metadata"]["name"]
    body = await kube.get(API_VERSION, "RolloutPool", namespace, ref.name)
    pool = RolloutPool.model_validate(body).spec if body is not None else None
    others = []
    for other in await kube.list(API_VERSION, "RLJob", namespace):
        try:
            o = RLJob.model_validate(other).spec
        except ValidationError:
            continue
        meta = other["metadata"]
        others.append(PoolUser(meta["name"], o, str(meta.get("creationTimestamp") or "")))
    return pool_ref_problem(spec, job, created, pool, others, namespace=namespace, unloading=unloading)


async def _check_teacher_pools(
    kube: KubeClient, namespace: str, spec: RLJobSpec
) -> tuple[str | None, str | None]:
    """(waiting, invalid) for the standalone pools the job's teachers name (policy.teacher_pools)."""
    names = sorted(set(standalone_teachers(spec).values()))
    bodies = await asyncio.gather(*(kube.get(API_VERSION, "RolloutPool", namespace, n) for n in names))
    pools = {n: RolloutPool.model_validate(b).spec if b else None for n, b in zip(names, bodies, strict=True)}
    return teacher_pool_problem(spec, pools, namespace)


async def _observe(
    kube: KubeClient,
    namespace: str,
    job: str,
    gang_problem: str | None,
    channel: Manifest | None,
    pool_used: str | None = None,
    teacher_pools: list[str] | None = None,
) -> JobObserved:
    """The children and the progress channel. `channel` is the WeightChannel read before the config
    ConfigMap was applied: status.transport on the job then always matches its transport.json.
    `pool_used`: the pool the job samples on (a standalone one with rollout.poolRef)."""
    pool_used = pool_used or pool_name(job)
    pool, trainer, progress_cm, driver, engines = await asyncio.gather(
        kube.get(API_VERSION, "RolloutPool", namespace, pool_used),
        kube.get(API_VERSION, "TrainerGroup", namespace, trainer_name(job)),
        kube.get("v1", "ConfigMap", namespace, progress_name(job)),
        kube.get("v1", "Pod", namespace, driver_name(job)),
        kube.list("v1", "Pod", namespace, selector=selector({LABEL_POOL: pool_used, LABEL_ROLE: "engine"})),
    )
    engine_failures = (
        f"{p['metadata']['name']}: {failure}"
        for p in sorted(engines, key=lambda p: str(p["metadata"]["name"]))
        if (failure := init_failure(p)) is not None
    )
    progress, problem = read_progress(progress_cm)
    driver_restarts, driver_last_exit = main_restarts(driver)
    teachers = await asyncio.gather(
        *(kube.get(API_VERSION, "RolloutPool", namespace, t) for t in teacher_pools or [])
    )
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
        driver_restarts=driver_restarts,
        driver_last_exit=driver_last_exit,
        engine_init_failure=next(engine_failures, None),
        teacher_pools={
            t: previous_status(body, RolloutPoolStatus) if body else None
            for t, body in zip(teacher_pools or [], teachers, strict=True)
        },
    )
