"""Each kind's status as a pure function of its spec and what was observed; written once per pass.

Why it exists: the status is the operator's whole user interface (`kubectl get rljobs` columns,
conditions, per-engine versions). Each function here composes the named policies of
lockstep_operator.policy (phase, failure, success, every condition) into one status model, so every
rule has a table test there and the composition a golden test in operator/tests/test_status.py. No
I/O; the clock is passed in. Called by the reconciles, after they observed the children.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from lockstep.api.rljob import Phase, RLJobSpec, RLJobStatus, Transport
from lockstep.api.rolloutpool import EngineStatus, RolloutPoolStatus
from lockstep.api.trainergroup import TrainerGroupStatus
from lockstep.api.weightchannel import WeightChannelStatus

from lockstep_operator.policy import channel_conditions, pool_conditions, reconcile_error, trainer_conditions
from lockstep_operator.policy.condition import apply, condition, is_true, set_condition
from lockstep_operator.policy.job_conditions import job_conditions
from lockstep_operator.policy.job_failure import deadline_exceeded
from lockstep_operator.policy.job_observed import TERMINAL, JobObserved, Verdict
from lockstep_operator.policy.job_phase import job_phase
from lockstep_operator.reconcile.progress import ProgressReport
from lockstep_operator.resources.common import ENGINE_PORT, LABEL_REPLICA
from lockstep_operator.topology import Decision

__all__ = [
    "JobObserved",
    "channel_status",
    "condition",
    "engine_ready",
    "is_true",
    "job_status",
    "pool_status",
    "set_condition",
    "trainer_status",
    "weights_current",
]

# ------------------------------------------------------------------------------------------ RLJob


def job_verdict(spec: RLJobSpec, obs: JobObserved, prev: RLJobStatus, now: dt.datetime) -> Verdict:
    """The phase (job_phase), failed past the deadline; a terminal phase keeps why it first ended."""
    verdict = job_phase(spec, obs, prev.phase)
    if verdict.phase not in TERMINAL:
        verdict = deadline_exceeded(spec, prev.start_time, now) or verdict
    if prev.phase in TERMINAL:
        ended = condition(prev.conditions, "Failed" if prev.phase == Phase.FAILED else "Complete")
        if ended is not None:
            verdict = Verdict(verdict.phase, ended.reason, ended.message)
    return verdict


def job_status(
    spec: RLJobSpec,
    obs: JobObserved,
    previous: RLJobStatus | None,
    *,
    generation: int | None,
    now: dt.datetime,
) -> RLJobStatus:
    """The RLJob status for what was observed (pure): the verdict, its conditions, the folded metrics."""
    prev = previous or RLJobStatus()
    verdict = job_verdict(spec, obs, prev, now)
    phase, progress, channel = verdict.phase, obs.progress, obs.channel
    pool_version = obs.pool.weight_version if obs.pool else None
    chosen = channel.transport if channel is not None else None
    conditions = apply(prev.conditions, job_conditions(spec, obs, verdict), now=now, generation=generation)
    children = [(kind, child.conditions) for kind, child in _children(obs)]
    return RLJobStatus(
        phase=phase,
        conditions=reconcile_error.fold_children(conditions, children, now=now, generation=generation),
        observed_generation=generation,
        step=progress.step if progress else prev.step,
        weight_version=pool_version if pool_version is not None else prev.weight_version,
        reward=progress.reward if progress else prev.reward,
        staleness=progress.staleness if progress else prev.staleness,
        avg_staleness=progress.avg_staleness if progress else prev.avg_staleness,
        queue_size=progress.queue_size if progress else prev.queue_size,
        transport=chosen.value if chosen else prev.transport,
        transport_reason=channel.reason if channel is not None and chosen else prev.transport_reason,
        restarts=obs.trainer.restarts if obs.trainer else prev.restarts,
        sandbox_aborts=progress.sandbox_aborts
        if progress and progress.sandbox_aborts is not None
        else prev.sandbox_aborts,
        start_time=prev.start_time or (now if phase == Phase.RUNNING else None),
        completion_time=prev.completion_time or (now if phase in TERMINAL else None),
    )


def _children(obs: JobObserved) -> list[tuple[str, Any]]:
    found = (("RolloutPool", obs.pool), ("TrainerGroup", obs.trainer), ("WeightChannel", obs.channel))
    return [(kind, status) for kind, status in found if status is not None]


# ------------------------------------------------------------------------------------ RolloutPool


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """Pod phase Running with condition Ready=True."""
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def engine_version(
    pod: Mapping[str, Any], engine_versions: Mapping[str, int], address_versions: Mapping[str, int]
) -> int | None:
    """The weight version the driver reported for this engine: by pod name, else by `<pod IP>:<port>`."""
    version = engine_versions.get(pod["metadata"]["name"])
    ip = (pod.get("status") or {}).get("podIP")
    if version is None and ip:
        version = address_versions.get(f"{ip}:{ENGINE_PORT}")
    return version


def weights_current(
    pod: Mapping[str, Any],
    current_version: int | None,
    engine_versions: Mapping[str, int],
    address_versions: Mapping[str, int] | None = None,
) -> tuple[bool, str]:
    """Whether the engine holds `current_version` (the readiness gate's status), and why (pure).

    True before any version is published (every engine starts from the same checkpoint). A report
    without any per-engine version (a driver that cannot reach the engines one by one) leaves the
    push's own guarantee standing (a weight update reaches every engine or fails the run): True. An
    engine missing from a report that has per-engine versions (new, replaced, unreachable) is False.
    """
    addresses = address_versions or {}
    if current_version is None:
        return True, "no weight version published yet"
    if not engine_versions and not addresses:
        return True, f"version {current_version} pushed; the driver reports no per-engine versions"
    version = engine_version(pod, engine_versions, addresses)
    if version == current_version:
        return True, f"holds the current weight version {current_version}"
    held = "not reported" if version is None else f"holds {version}"
    return False, f"{held}; the current weight version is {current_version}"


def shared_weights_current(
    pod: Mapping[str, Any], jobs: Sequence[tuple[str, ProgressReport | None]]
) -> tuple[bool, str]:
    """Whether an engine of a standalone pool holds the current adapter of every job sampling on it
    (the readiness gate of a shared pool, pure): `jobs` are the running jobs whose rollout.poolRef
    names the pool, with their progress reports. Each job's report carries the adapter version each
    engine holds (the driver's probe reads GET /v1/models); weights_current decides per job, so an
    engine that joined after a job published a version stays out of the router until that job's
    trainer has loaded its next version there. No job: True (the base never changes)."""
    for job, report in sorted(jobs, key=lambda j: j[0]):
        if report is None:
            continue  # nothing reported yet: nothing published
        current, why = weights_current(
            pod, report.weight_version, report.engine_versions, report.engine_address_versions or {}
        )
        if not current:
            return False, f"RLJob {job}'s adapter: {why}"
    if not jobs:
        return True, "no running job samples on the pool; its base never changes"
    names = ", ".join(sorted(j for j, _ in jobs))
    return True, f"holds the current adapter of every running job on the pool ({names})"


def engine_ready(
    pod: Mapping[str, Any],
    current_version: int | None,
    engine_versions: Mapping[str, int],
    address_versions: Mapping[str, int] | None = None,
) -> bool:
    """An engine is ready when its pod is Ready and it holds `current_version` (weights_current)."""
    return pod_ready(pod) and weights_current(pod, current_version, engine_versions, address_versions)[0]


def pool_status(
    pods: Sequence[Mapping[str, Any]],
    *,
    selector: str,
    current_version: int | None,
    engine_versions: Mapping[str, int],
    min_available: int,
    previous: RolloutPoolStatus | None,
    address_versions: Mapping[str, int] | None = None,
    generation: int | None,
    now: dt.datetime,
) -> RolloutPoolStatus:
    """Pool status: an engine is ready only when its pod is Ready and it holds `current_version`.

    Per-engine versions come from the driver's progress report, keyed by pod name or by pod address
    (weights_current says how a missing or empty report counts).
    """
    engines: list[EngineStatus] = []
    for pod in sorted(pods, key=lambda p: int(p["metadata"]["labels"].get(LABEL_REPLICA, "0"))):
        name = pod["metadata"]["name"]
        ip = (pod.get("status") or {}).get("podIP")
        version = engine_version(pod, engine_versions, address_versions or {})
        engines.append(
            EngineStatus(
                name=name,
                address=f"{ip}:{ENGINE_PORT}" if ip else None,
                ready=engine_ready(pod, current_version, engine_versions, address_versions),
                weight_version=version,
            )
        )
    ready = [e for e in engines if e.ready]
    versions = {e.weight_version for e in ready}
    common = next(iter(versions)) if len(versions) == 1 else None
    lagging = [
        e.name
        for e in engines
        if not e.ready and current_version is not None and e.weight_version != current_version
    ]
    updates = [
        pool_conditions.available(len(ready), len(engines), min_available),
        pool_conditions.min_available_breached(len(ready), min_available),
        pool_conditions.weights_synced(current_version, lagging),
    ]
    before = reconcile_error.without_error(previous.conditions) if previous else []
    conds = apply(before, updates, now=now, generation=generation)
    return RolloutPoolStatus(
        replicas=len(engines),
        ready_replicas=len(ready),
        selector=selector,
        weight_version=common,
        engines=engines,
        conditions=conds,
        observed_generation=generation,
    )


# ----------------------------------------------------------------------------------- TrainerGroup


def trainer_status(
    pods: Sequence[Mapping[str, Any]],
    *,
    nodes: int,
    gpus_per_node: int,
    restarts: int,
    failed: str | None,
    previous: TrainerGroupStatus | None,
    step: int | None,
    generation: int | None,
    now: dt.datetime,
    rolling: str | None = None,
) -> TrainerGroupStatus:
    """Trainer status; `failed` is the reason message once the gang restart limit is exhausted.

    `rolling`: the pod-template hash the gang is being restarted to after a spec change (None when
    every rank runs the current template). Such restarts are recorded in condition UpToDate (reason
    SpecChanged, kept after the roll finished) and never in `restarts`.
    """
    ready_pods = sum(1 for p in pods if pod_ready(p))
    before = reconcile_error.without_error(previous.conditions) if previous else []
    rolled = trainer_conditions.up_to_date(condition(before, "UpToDate"), rolling)
    updates = [
        *([rolled] if rolled is not None else []),
        trainer_conditions.available(ready_pods, nodes),
        trainer_conditions.degraded(ready_pods, nodes, restarts),
        trainer_conditions.failed(failed),
    ]
    conds = apply(before, updates, now=now, generation=generation)
    return TrainerGroupStatus(
        world_size=nodes * gpus_per_node,
        ready_ranks=ready_pods * gpus_per_node,
        step=step,
        restarts=restarts,
        conditions=conds,
        observed_generation=generation,
    )


# ---------------------------------------------------------------------------------- WeightChannel


def slowest_phase(phases: dict[str, float] | None) -> str | None:
    """`transfer 62%`: the phase of the last update that took longest and its share (pure)."""
    if not phases:
        return None
    total = sum(max(v, 0.0) for v in phases.values())
    name, seconds = max(phases.items(), key=lambda kv: kv[1])
    return f"{name} {100 * seconds / total:.0f}%" if total > 0 else name


def channel_status(
    decision: Decision,
    *,
    progress: ProgressReport | None,
    previous: WeightChannelStatus | None,
    generation: int | None,
    now: dt.datetime,
) -> WeightChannelStatus:
    """Channel status: the transport choice and its reason, the preflight result, the last update."""
    prev = previous or WeightChannelStatus()
    transport = Transport(decision.transport) if decision.transport else prev.transport
    keep = (
        decision.transport is None and prev.transport is not None
    )  # pods unscheduled a while: keep the choice
    reason = prev.reason if keep else decision.reason
    updates = [channel_conditions.ready(transport is not None, reason)]
    if not keep:  # the verdict on the requested transport belongs to the choice it came with
        updates.append(channel_conditions.requested_transport_feasible(decision.override_rejected))
    passed = prev.preflight_passed
    if progress is not None and progress.preflight is not None:
        passed = progress.preflight == "passed"
        updates.append(channel_conditions.preflight_passed(passed, progress.preflight_mismatched))
    fallback = progress.last_update_fallback if progress else prev.last_update_fallback
    fallbacks = progress.update_fallbacks if progress else prev.update_fallbacks
    if progress is not None and progress.last_update_seconds is not None:
        updates.append(channel_conditions.degraded(
            transport.value if transport else None, fallback, progress.weight_version, fallbacks
        ))  # fmt: skip
    conds = apply(reconcile_error.without_error(prev.conditions), updates, now=now, generation=generation)
    version = prev.weight_version
    current = progress.weight_version if progress is not None else None
    reported = {**progress.engine_versions, **(progress.engine_address_versions or {})} if progress else {}
    if current is not None and reported:
        version = current if all(v >= current for v in reported.values()) else version
    phases = progress.last_update_phases if progress else prev.last_update_phases
    return WeightChannelStatus(
        transport=transport,
        reason=reason,
        weight_version=version,
        last_update_seconds=progress.last_update_seconds if progress else prev.last_update_seconds,
        wire_bytes=progress.wire_bytes if progress else prev.wire_bytes,
        last_update_phases=phases,
        last_update_fallback=fallback,
        update_fallbacks=fallbacks,
        last_update_slowest=slowest_phase(phases),
        last_update_time=prev.last_update_time if version == prev.weight_version else now,
        preflight_passed=passed,
        conditions=conds,
        observed_generation=generation,
    )
