"""Engine pods of a RolloutPool, rendered from the pool's spec, and their readiness-gate condition.

Why it exists: the pool reconcile compares every live engine with a fresh rendering (the pod-template
hash) to decide what to roll, so rendering is pure and lives here with the other builders. The gate
condition rl.lockstep.dev/weights-current is applied on pods/status by itself (conditions merge by
type), so the kubelet's own conditions are untouched. Called by the RolloutPool reconcile.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from lockstep.api.rljob import Engine
from lockstep.api.rolloutpool import RolloutPoolSpec

from lockstep_operator.resources import podgroups
from lockstep_operator.resources.commands import engine_command
from lockstep_operator.resources.common import (
    API_KEY_ENV,
    API_KEY_ITEM,
    LABEL_JOB,
    LABEL_POOL,
    LABEL_ROLE,
    WEIGHTS_CURRENT,
    Manifest,
    Owner,
    api_key_secret_name,
    pool_scope,
)
from lockstep_operator.resources.delta_agent import with_delta_agent
from lockstep_operator.resources.metrics_relay import with_metrics_relay
from lockstep_operator.resources.model import model_convert, model_pull, serving_model
from lockstep_operator.resources.platforms import NodeFacts, default_facts
from lockstep_operator.resources.pods import (
    Container,
    Placement,
    engine_pod,
    run_dir,
    with_architectures,
    with_template_hash,
)
from lockstep_operator.resources.sglang import TRUE_ON_POLICY_ENV

GPU_SHM = "32Gi"
"""/dev/shm of a GPU engine (SGLang's docs run its container with a 32 GB shared memory)."""
CPU_SHM = "1Gi"
"""/dev/shm of a CPU engine."""


def engine_container(
    spec: RolloutPoolSpec, image: str, shared_volume: str | None, pool: str = ""
) -> Container:
    """What an engine replica runs: the command, a sized /dev/shm, the job's API key (from its
    Secret; both engines require it), for SGLang the true-on-policy environment, and for a
    low-precision engine the conversion step whose checkpoint the command serves. A reference engine
    with the shared volume reads disk updates only under the job's directory on it (--weights-root).
    A standalone pool (`pool`, no job) uses its own Secret and directory (resources.common.pool_scope)."""
    scope = pool_scope(spec.job, pool)
    sglang = spec.engine.engine is Engine.SGLANG
    precision = spec.engine.precision
    command = engine_command(  # the model volume's path (the converted one for fp8 ...), not the hub id
        spec.engine,
        serving_model(spec.model, precision),
        r3=spec.r3,
        true_on_policy=spec.true_on_policy,
    )
    if not sglang and shared_volume:  # disk updates only from the job's directory of the shared volume
        command += ["--weights-root", run_dir(scope, shared=True)]
    return Container(
        image=spec.engine.image or image,
        command=command,
        env=dict(TRUE_ON_POLICY_ENV) if sglang and spec.true_on_policy else {},
        secret_env={API_KEY_ENV: (api_key_secret_name(scope), API_KEY_ITEM)},
        shared_volume_claim=shared_volume or None,
        shm_size=GPU_SHM if spec.engine.gpus_per_engine > 0 else CPU_SHM,
        model=model_pull(spec.model, image),
        convert=model_convert(spec.model, precision, image),
    )


def engine_placement(
    spec: RolloutPoolSpec, pool: str, avoid_clique: str | None = None, facts: NodeFacts | None = None
) -> Placement:
    """GPU requests and node selection of one engine replica of pool `pool` (before its images'
    architectures)."""
    place = spec.placement
    return Placement(
        gpus=spec.engine.gpus_per_engine,
        product=(facts or default_facts()).product_label(place.gpu_product.value),
        node_selector=dict(place.node_selector),
        tolerations=[t.wire() for t in place.tolerations],
        avoid_clique=avoid_clique or None,
        # The pool's other engines, and its job's ranks (a standalone pool has none: its jobs' ranks follow it).
        near=(
            {LABEL_POOL: pool, LABEL_ROLE: "engine"},
            *([{LABEL_JOB: spec.job, LABEL_ROLE: "trainer"}] if spec.job else []),
        ),
    )


def engine_manifest(
    owner: Owner,
    spec: RolloutPoolSpec,
    replica: int,
    *,
    gang_min: int,
    image: str,
    shared_volume: str | None = None,
    avoid_clique: str | None = None,
    facts: NodeFacts | None = None,
    delta_agent: str | None = None,
    runtime_image: str | None = None,
) -> Manifest:
    """Engine pod `replica` of the pool (pure), annotated with its pod-template hash (the pod spec:
    image, command with the engine arguments, env, resources, placement; never replicas or gang
    membership).
    Replicas below the pool's min_available are gang members. `facts`: the operator settings' GPU
    product labels and image architectures. `delta_agent` (the pool's annotation; with the shared
    volume): the disk-delta agent sidecar (resources.delta_agent). An SGLang engine gets the metrics
    relay sidecar serving its `sglang:*` series on the `metrics` port (resources.metrics_relay).
    Sidecars run `runtime_image` (the runtime's; default `image`)."""
    facts = facts or default_facts()
    gang = spec.placement.gang
    scope = pool_scope(spec.job, owner.name)
    keys = podgroups.member_keys(
        job=scope,
        scheduler=gang.scheduler.value,
        min_member=gang_min,
        queue=gang.queue_name,
        member=replica < spec.min_available,
    )
    container = engine_container(spec, image, shared_volume, owner.name)
    sidecar_image = runtime_image or image
    agent = bool(delta_agent and shared_volume)
    relay = spec.engine.engine is Engine.SGLANG
    sidecars = [sidecar_image] if agent or relay else []
    pod = engine_pod(
        owner,
        job=scope,
        pool=owner.name,
        replica=replica,
        container=container,
        placement=with_architectures(
            engine_placement(spec, owner.name, avoid_clique, facts), container, facts, sidecars
        ),
        gang=keys,
    )
    if agent and delta_agent:
        pod = with_delta_agent(pod, scope=scope, setting=delta_agent, image=sidecar_image,
                               reference=spec.engine.engine is Engine.REFERENCE)  # fmt: skip
    if relay:
        pod = with_metrics_relay(pod, image=sidecar_image)
    return with_template_hash(pod)


def weights_gate(pod: Mapping[str, Any], verdict: tuple[bool, str], now: dt.datetime) -> Manifest | None:
    """The pods/status apply setting the gate condition to `verdict`; None when it already says so.

    lastTransitionTime moves only when the status flips (a new message alone keeps it).
    """
    current, message = verdict
    value = "True" if current else "False"
    conditions = (pod.get("status") or {}).get("conditions") or []
    old = next((c for c in conditions if c.get("type") == WEIGHTS_CURRENT), None)
    if old is not None and old.get("status") == value and old.get("message") == message:
        return None
    changed = old is None or old.get("status") != value
    since = (
        now.isoformat().replace("+00:00", "Z") if changed or old is None else old.get("lastTransitionTime")
    )
    condition = {
        "type": WEIGHTS_CURRENT,
        "status": value,
        "reason": "WeightsCurrent" if current else "WeightsBehind",
        "message": message,
        "lastTransitionTime": since,
    }
    meta = pod["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "status": {"conditions": [condition]},
    }
