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
from lockstep_operator.resources.commands import engine_command, product_label
from lockstep_operator.resources.common import (
    API_KEY_ENV,
    API_KEY_ITEM,
    WEIGHTS_CURRENT,
    Manifest,
    Owner,
    api_key_secret_name,
)
from lockstep_operator.resources.model import model_convert, model_pull, serving_model
from lockstep_operator.resources.pods import Container, Placement, engine_pod, with_template_hash
from lockstep_operator.resources.sglang import TRUE_ON_POLICY_ENV

GPU_SHM = "32Gi"
"""/dev/shm of a GPU engine (SGLang's docs run its container with a 32 GB shared memory)."""
CPU_SHM = "1Gi"
"""/dev/shm of a CPU engine."""


def engine_container(spec: RolloutPoolSpec, image: str, shared_volume: str | None) -> Container:
    """What an engine replica runs: the command, a sized /dev/shm, the job's API key (from its
    Secret; both engines require it), for SGLang the true-on-policy environment, and for a
    low-precision engine the conversion step whose checkpoint the command serves."""
    sglang = spec.engine.engine is Engine.SGLANG
    precision = spec.engine.precision
    return Container(
        image=spec.engine.image or image,
        command=engine_command(  # the model volume's path (the converted one for fp8 ...), not the hub id
            spec.engine,
            serving_model(spec.model, precision),
            r3=spec.r3,
            true_on_policy=spec.true_on_policy,
        ),
        env=dict(TRUE_ON_POLICY_ENV) if sglang and spec.true_on_policy else {},
        secret_env={API_KEY_ENV: (api_key_secret_name(spec.job), API_KEY_ITEM)},
        shared_volume_claim=shared_volume or None,
        shm_size=GPU_SHM if spec.engine.gpus_per_engine > 0 else CPU_SHM,
        model=model_pull(spec.model, image),
        convert=model_convert(spec.model, precision, image),
    )


def engine_placement(spec: RolloutPoolSpec, avoid_clique: str | None = None) -> Placement:
    """GPU requests and node selection of one engine replica."""
    place = spec.placement
    return Placement(
        gpus=spec.engine.gpus_per_engine,
        product=product_label(place.gpu_product.value),
        node_selector=dict(place.node_selector),
        tolerations=[t.wire() for t in place.tolerations],
        avoid_clique=avoid_clique or None,
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
) -> Manifest:
    """Engine pod `replica` of the pool (pure), annotated with its pod-template hash (the pod spec:
    image, command with the engine arguments, env, resources, placement; never replicas or gang
    membership).
    Replicas below the pool's min_available are gang members."""
    gang = spec.placement.gang
    keys = podgroups.member_keys(
        job=spec.job,
        scheduler=gang.scheduler.value,
        min_member=gang_min,
        queue=gang.queue_name,
        member=replica < spec.min_available,
    )
    pod = engine_pod(
        owner,
        job=spec.job,
        pool=owner.name,
        replica=replica,
        container=engine_container(spec, image, shared_volume),
        placement=engine_placement(spec, avoid_clique),
        gang=keys,
    )
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
