"""Every annotation key the operator reads or writes, in one enum under the API group's prefix.

Why it exists: the RLJob reconcile tells its children what their specs do not carry (suspended,
stopped, the gang's size, the restart limit, the placement plan) through annotations it owns by
server-side apply; pods carry their gang generation and pod-template hash; users set one key
(`autoscaler`). One enum keeps the keys under one prefix (rl.lockstep.dev, the API group, as the
labels are) and makes a typo a NameError instead of a silently ignored key.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from lockstep_operator.resources.common import GROUP


class Annotation(enum.StrEnum):
    """Annotation keys (values are the literal keys on live objects: renaming one needs a migration)."""

    SUSPENDED = f"{GROUP}/suspended"
    """On pool and trainer: "true" while the job is suspended (no pods; spec.replicas kept)."""
    STOPPED = f"{GROUP}/stopped"
    """On pool and trainer: the job's terminal phase once it finished or failed (pods deleted)."""
    GANG_MIN = f"{GROUP}/gang-min-member"
    """On pool and trainer: the gang's minMember (all trainer rank pods + the pool's min_available)."""
    RESTART_LIMIT = f"{GROUP}/restart-limit"
    """On the trainer: gang restarts allowed (the RLJob's backoffLimit)."""
    COLOCATE = f"{GROUP}/colocate"
    """On the channel: "true" when trainer and engines share GPUs (schedule.colocate), "cpu" when
    colocated on CPU (nothing to share across pods: resources.colocation), else "false"."""
    ENGINE_P2P = f"{GROUP}/engine-p2p"
    """On the channel: "true" when the engines serve the P2P receive side (the reference engine, or an
    SGLang image declared with rollout.p2pReceiver); otherwise p2p is never chosen."""
    P2P_RANKS = f"{GROUP}/p2p"
    """On the trainer: "true" when weightSync.transport is p2p: the ranks get RDMA devices and IPC_LOCK."""
    SHARED_VOLUME = f"{GROUP}/shared-volume"
    """On pool and trainer: the ReadWriteMany claim mounted at /shared (weightSync.diskDelta.volumeClaim)."""
    DELTA_AGENT = f"{GROUP}/delta-agent"
    """On the pool: where each engine keeps the copy its disk-delta agent patches (weightSync.diskDelta.path,
    or "emptyDir"); "" or absent: no agent (resources.delta_agent)."""
    JOB_REPLICAS = f"{GROUP}/job-replicas"
    """On the pool: the RLJob's rollout.replicas last copied into pool spec.replicas."""
    POOL_ADAPTERS = f"{GROUP}/adapters"
    """On a standalone pool: the LoRA adapter names of the jobs that used it (JSON list), kept until the
    operator has unloaded a deleted or ended job's versions from every engine (policy.adapter_gc)."""
    ADAPTER = f"{GROUP}/adapter"
    """On an unload pod of a standalone pool: the adapter whose versions it unloads."""
    SHARED_POOL = f"{GROUP}/shared-pool"
    """On the trainer group: the standalone RolloutPool the job uses (rollout.poolRef), "" for its own."""
    GANG_COMPLETE = f"{GROUP}/gang-complete"
    """On the trainer, written by its reconcile: the gang generation whose every rank pod was created
    ("" once a roll or a stop deleted its ranks): a rank of it missing later was deleted (a fault)."""
    CLIQUE = f"{GROUP}/clique"
    """On the trainer: the NVLink domain its ranks were packed into ("" = none)."""
    AVOID_CLIQUE = f"{GROUP}/avoid-clique"
    """On the pool: the trainer's NVLink domain, which engines stay out of ("" = no rule)."""
    CONFIG_HASH = f"{GROUP}/config-hash"
    """On the trainer: hash of the run config the ranks read from job.yaml (resources.children.
    run_config_hash); part of the rank pods' template hash, so a learning-rate edit restarts the gang."""
    QUEUE_HISTORY = f"{GROUP}/queue-history"
    """On the pool: recent [time, step, queueSize, capacity] samples for the autoscaling policy."""
    LAST_SCALED = f"{GROUP}/last-scaled"
    """On the pool: [time, step] of the last autoscaling change."""
    AUTOSCALER = f"{GROUP}/autoscaler"
    """On the pool, set by users: "external" when HPA/KEDA drive /scale (the built-in policy stays off)."""
    GANG_GENERATION = f"{GROUP}/gang-generation"
    """On rank pods: the TrainerGroup restart count they belong to (a gang restart bumps it)."""
    POD_TEMPLATE_HASH = f"{GROUP}/pod-template-hash"
    """On every pod: the hash of what it was rendered from (resources.pods.pod_template_hash); a pod
    whose hash differs from a fresh rendering is rolled (engines one at a time, ranks as a gang)."""


def annotations_of(body: Mapping[str, Any]) -> dict[str, str]:
    """metadata.annotations of an object ({} when none)."""
    return dict((body.get("metadata") or {}).get("annotations") or {})
