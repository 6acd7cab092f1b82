"""The RLJob's three child kinds (RolloutPool, TrainerGroup, WeightChannel) and the run config hash.

Why it exists: the job tells its children what their specs do not carry (suspend, stop, the gang's
size, the restart limit, the placement plan) through annotations it owns by server-side apply; the
pool's spec.replicas is left out on purpose (set once at creation, then /scale owns it). The run
config hash decides which edits of the job restart the driver and the ranks (docs/operator.md,
"Spec changes roll pods"). Called by the RLJob reconcile; golden-tested.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from lockstep.api.rljob import Engine, EngineSpec, RLJobSpec, Transport, teacher_pool_name

from lockstep_operator.resources.annotations import Annotation
from lockstep_operator.resources.colocation import colocate_annotation
from lockstep_operator.resources.common import (
    API_VERSION,
    Manifest,
    Owner,
    channel_name,
    job_labels,
    metadata,
    pool_name,
    trainer_name,
    used_pool,
)
from lockstep_operator.resources.delta_agent import EMPTY_DIR
from lockstep_operator.resources.podgroups import gang_min_member

NOT_ROLLED = ("suspend", "activeDeadlineSeconds", "backoffLimit")
"""Top-level spec fields only the operator acts on: editing them never restarts a pod."""
NOT_ROLLED_ROLLOUT = ("replicas", "autoscaling")
"""spec.rollout fields that follow /scale: editing them never restarts a pod."""


def run_config_hash(spec: RLJobSpec) -> str:
    """16 hex digits of sha256 over the run config the driver and trainer ranks read (pure).

    That is the spec as rendered into job.yaml minus what only the operator acts on (NOT_ROLLED,
    NOT_ROLLED_ROLLOUT): scaling, suspend and limits change no running process. It is part of the
    driver's and the ranks' pod-template hash; engines read no job.yaml (their pod spec says it all).
    """
    wire = {k: v for k, v in spec.wire().items() if k not in NOT_ROLLED}
    wire["rollout"] = {k: v for k, v in wire.get("rollout", {}).items() if k not in NOT_ROLLED_ROLLOUT}
    text = json.dumps(wire, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def engine_part(spec: RLJobSpec) -> dict[str, Any]:
    """The pool's `engine` section: RolloutSpec extends EngineSpec, the pool takes only EngineSpec's fields."""
    part: dict[str, Any] = EngineSpec.model_validate(
        spec.rollout.model_dump(include=set(EngineSpec.model_fields))
    ).wire()
    return part


def engine_serves_p2p(engine: EngineSpec) -> bool:
    """Whether the engines can receive P2P writes: the reference engine always; stock SGLang never, so
    an SGLang image must declare the extension (rollout.p2pReceiver; docs/sglang.md)."""
    return engine.engine is Engine.REFERENCE or engine.p2p_receiver


def delta_agent_setting(spec: RLJobSpec) -> str:
    """Where each engine's disk-delta agent keeps its copy (resources.delta_agent): an explicit
    disk-delta with a shared volume gets agents (diskDelta.path as a hostPath, else an emptyDir);
    "" otherwise (with `auto` the trainer patches one copy per engine on the shared volume itself)."""
    sync = spec.weight_sync
    if sync.transport is not Transport.DISK_DELTA or sync.disk_delta.volume_claim is None:
        return ""
    return sync.disk_delta.path or EMPTY_DIR


def child_manifests(
    owner: Owner, spec: RLJobSpec, *, suspended: bool, stopped: str, clique: str = "", avoid_clique: str = ""
) -> list[Manifest]:
    """The three child kinds of the job (pure; pool spec.replicas deliberately left out).

    `clique`/`avoid_clique`: the placement plan (reconcile.placement), fixed once per job.
    """
    job = owner.name
    common_ann = {
        Annotation.SUSPENDED.value: str(suspended).lower(),
        Annotation.STOPPED.value: stopped,
        Annotation.GANG_MIN.value: str(gang_min_member(spec)),
        Annotation.SHARED_VOLUME.value: spec.weight_sync.disk_delta.volume_claim or "",
    }
    pool_ann = {
        **common_ann,
        Annotation.JOB_REPLICAS.value: str(spec.rollout.replicas),
        Annotation.AVOID_CLIQUE.value: avoid_clique,
        **({Annotation.DELTA_AGENT.value: agent} if (agent := delta_agent_setting(spec)) else {}),
    }
    pool = {
        "apiVersion": API_VERSION,
        "kind": "RolloutPool",
        "metadata": metadata(owner, pool_name(job), job_labels(job), pool_ann),
        "spec": {
            "job": job,
            "model": spec.model.wire(),
            "engine": engine_part(spec),
            "placement": spec.placement.wire(),
            **({"autoscaling": spec.rollout.autoscaling.wire()} if spec.rollout.autoscaling else {}),
            **({"r3": True} if spec.algorithm.r3 else {}),
            **({"trueOnPolicy": True} if spec.algorithm.true_on_policy else {}),
        },
    }
    shared = spec.rollout.pool_ref.name if spec.rollout.pool_ref else None
    trainer_ann = {
        **common_ann,
        **({Annotation.SHARED_POOL.value: shared} if shared else {}),
        Annotation.RESTART_LIMIT.value: str(spec.backoff_limit),
        Annotation.CLIQUE.value: clique,
        Annotation.CONFIG_HASH.value: run_config_hash(spec),
        Annotation.P2P_RANKS.value: str(spec.weight_sync.transport is Transport.P2P).lower(),
    }
    trainer = {
        "apiVersion": API_VERSION,
        "kind": "TrainerGroup",
        "metadata": metadata(owner, trainer_name(job), job_labels(job), trainer_ann),
        "spec": {
            "job": job,
            "model": spec.model.wire(),
            "trainer": spec.trainer.wire(),
            "placement": spec.placement.wire(),
            "preemptionGraceSeconds": spec.schedule.preemption_grace_seconds,
        },
    }
    channel_ann = {
        Annotation.COLOCATE.value: colocate_annotation(spec),
        Annotation.ENGINE_P2P.value: str(engine_serves_p2p(spec.rollout)).lower(),
    }
    channel = {
        "apiVersion": API_VERSION,
        "kind": "WeightChannel",
        "metadata": metadata(owner, channel_name(job), job_labels(job), channel_ann),
        "spec": {
            "job": job,
            "trainerGroup": trainer_name(job),
            "rolloutPool": used_pool(job, shared),
            "weightSync": spec.weight_sync.wire(),
        },
    }
    return [pool, trainer, channel]


def teacher_pool_manifests(owner: Owner, spec: RLJobSpec, *, suspended: bool, stopped: str) -> list[Manifest]:
    """The RolloutPool of each checkpoint teacher of spec.algorithm.opd (pure; spec.replicas left out,
    as for the job's pool): role teacher, the teacher's checkpoint served with the rollout's engine
    settings (and its numerics: true on-policy kernels when the job runs them), never updated."""
    opd = spec.algorithm.opd
    if opd is None:
        return []
    job = owner.name
    out = []
    for teacher in opd.teachers:
        if teacher.checkpoint is None:
            continue  # a url teacher runs outside the cluster's control
        ann = {
            Annotation.SUSPENDED.value: str(suspended).lower(),
            Annotation.STOPPED.value: stopped,
            Annotation.JOB_REPLICAS.value: str(teacher.replicas),
        }
        model = spec.model.model_copy(update={"checkpoint": teacher.checkpoint, "lora": None}).wire()
        out.append(
            {
                "apiVersion": API_VERSION,
                "kind": "RolloutPool",
                "metadata": metadata(owner, teacher_pool_name(job, teacher.name), job_labels(job), ann),
                "spec": {
                    "job": job,
                    "role": "teacher",
                    "model": model,
                    "engine": engine_part(spec),
                    "placement": spec.placement.wire(),
                    **({"trueOnPolicy": True} if spec.algorithm.true_on_policy else {}),
                },
            }
        )
    return out
