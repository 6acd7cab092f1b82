"""Pure status computation: (spec, observed) -> status, for each kind. No I/O, the clock is passed in.

Why it exists: the status is the operator's whole user interface (`kubectl get rljobs` columns,
conditions, per-engine versions), and the phase rules are the part most worth testing. Keeping them
pure makes every rule a golden test (operator/tests/test_status.py).

Who calls it: the reconciles in this package, after they observed the children.

Job phases: Pending (children not created yet) -> Provisioning (pods being scheduled and started) ->
Preflight (all pods ready; the driver's init step and, when asked, the weight-equality check run) ->
Running (the WeightChannel reported PreflightPassed, or the driver reported its init step when the
check is off) -> Succeeded | Failed; Suspended while spec.suspend. Terminal phases are sticky. A
Running job whose pods fail stays Running with Degraded=True while the children recover.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lockstep.api.common import Condition, ConditionStatus
from lockstep.api.rljob import Phase, RLJobSpec, RLJobStatus, Transport
from lockstep.api.rolloutpool import EngineStatus, RolloutPoolStatus
from lockstep.api.trainergroup import TrainerGroupStatus
from lockstep.api.weightchannel import WeightChannelStatus

from lockstep_operator.reconcile.progress import ProgressReport
from lockstep_operator.resources.common import ENGINE_PORT, LABEL_REPLICA
from lockstep_operator.topology import Decision

TERMINAL = (Phase.SUCCEEDED, Phase.FAILED)


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    *,
    now: dt.datetime,
    generation: int | None,
) -> list[Condition]:
    """Return `conditions` with `type_` set; lastTransitionTime moves only when the status changes."""
    value = {True: ConditionStatus.TRUE, False: ConditionStatus.FALSE, None: ConditionStatus.UNKNOWN}[status]
    old = next((c for c in conditions if c.type == type_), None)
    updated = Condition(
        type=type_,
        status=value,
        reason=reason,
        message=message[:32768],
        last_transition_time=old.last_transition_time if old is not None and old.status == value else now,
        observed_generation=generation,
    )
    if old is None:
        return [*conditions, updated]
    return [updated if c.type == type_ else c for c in conditions]


def condition(conditions: Sequence[Condition], type_: str) -> Condition | None:
    """The condition of type `type_`, if any."""
    return next((c for c in conditions if c.type == type_), None)


def is_true(conditions: Sequence[Condition], type_: str) -> bool:
    """Whether the condition `type_` exists with status True."""
    cond = condition(conditions, type_)
    return cond is not None and cond.status == ConditionStatus.TRUE


# ------------------------------------------------------------------------------------------ RLJob


@dataclass(frozen=True, slots=True)
class JobObserved:
    """What the RLJob reconcile observed about its children."""

    pool: RolloutPoolStatus | None
    """Status of the owned RolloutPool (None before it exists or reports)."""
    trainer: TrainerGroupStatus | None
    """Status of the owned TrainerGroup."""
    channel: WeightChannelStatus | None
    """Status of the owned WeightChannel."""
    progress: ProgressReport | None
    """The driver's last progress report."""
    progress_problem: str | None
    """Why the progress document could not be read, if it could not."""
    driver_phase: str | None
    """Pod phase of the driver pod (None when it does not exist)."""
    gang_problem: str | None
    """Why the gang scheduler cannot be used (its CRDs are not served), if so."""


def _failure(spec: RLJobSpec, obs: JobObserved) -> tuple[str, str] | None:
    failed = condition(obs.trainer.conditions, "Failed") if obs.trainer is not None else None
    if failed is not None and failed.status == ConditionStatus.TRUE:
        return failed.reason, f"trainer: {failed.message}"
    progress = obs.progress
    if progress is not None and progress.preflight == "failed":
        names = ", ".join(progress.preflight_mismatched) or "(not named by the driver)"
        return "PreflightFailed", f"weight-equality check failed; tensors that differ: {names}"
    if progress is not None and progress.error:
        return "DriverError", progress.error
    if obs.driver_phase == "Failed":
        return "DriverFailed", "the driver pod failed"
    return None


def _ready(spec: RLJobSpec, obs: JobObserved) -> tuple[bool, str]:
    """Whether every pod the job needs is ready, and if not what is missing."""
    missing = []
    want_ranks = spec.trainer.nodes * spec.trainer.gpus_per_node
    if obs.trainer is None or obs.trainer.ready_ranks < want_ranks:
        have = obs.trainer.ready_ranks if obs.trainer else 0
        missing.append(f"trainer ranks ready {have}/{want_ranks}")
    autoscaling = spec.rollout.autoscaling
    want_engines = (
        min(spec.rollout.replicas, autoscaling.min_replicas) if autoscaling else spec.rollout.replicas
    )
    want_engines = max(want_engines, 1 if spec.rollout.replicas else 0)
    if obs.pool is None or obs.pool.ready_replicas < want_engines:
        have = obs.pool.ready_replicas if obs.pool else 0
        missing.append(f"engines ready {have}/{want_engines}")
    if obs.driver_phase != "Running":
        missing.append(f"driver {obs.driver_phase or 'not created'}")
    return not missing, "; ".join(missing)


def _phase(spec: RLJobSpec, obs: JobObserved, previous: Phase | None) -> tuple[Phase, str, str]:
    """(phase, reason, message)."""
    if previous in TERMINAL:
        return previous, "Terminal", f"job {previous.value.lower()}"
    if (failure := _failure(spec, obs)) is not None:
        return Phase.FAILED, failure[0], failure[1]
    if obs.progress is not None and obs.progress.done:
        return Phase.SUCCEEDED, "Completed", f"all {spec.schedule.steps} steps done"
    if spec.suspend:
        return Phase.SUSPENDED, "Suspended", "spec.suspend is true: pods scaled to zero"
    if obs.pool is None or obs.trainer is None:
        return Phase.PENDING, "CreatingChildren", "creating the pool, trainer group and weight channel"
    ready, missing = _ready(spec, obs)
    if previous == Phase.RUNNING:
        return Phase.RUNNING, "Running", missing or "all pods ready"
    if not ready:
        return Phase.PROVISIONING, "WaitingForPods", missing
    if spec.weight_sync.check_weight_update_equal:
        if obs.channel is not None and obs.channel.preflight_passed:
            return Phase.RUNNING, "PreflightPassed", "weight-equality check passed"
        return Phase.PREFLIGHT, "PreflightRunning", "waiting for the weight-equality check"
    if obs.progress is not None and obs.progress.step is not None:
        return Phase.RUNNING, "Initialized", "the driver finished its init step"
    return Phase.PREFLIGHT, "Initializing", "waiting for the driver's init step (initial weight sync)"


def job_status(
    spec: RLJobSpec,
    obs: JobObserved,
    previous: RLJobStatus | None,
    *,
    generation: int | None,
    now: dt.datetime,
) -> RLJobStatus:
    """The RLJob status for what was observed (pure)."""
    prev = previous or RLJobStatus()
    phase, reason, message = _phase(spec, obs, prev.phase)
    deadline = spec.active_deadline_seconds
    if (
        phase not in TERMINAL
        and deadline
        and prev.start_time
        and (now - prev.start_time).total_seconds() > deadline
    ):
        phase, reason = Phase.FAILED, "DeadlineExceeded"
        message = f"running longer than activeDeadlineSeconds={deadline}"
    if prev.phase in TERMINAL:  # keep why it ended, as first recorded
        ended = condition(prev.conditions, "Failed" if prev.phase == Phase.FAILED else "Complete")
        reason, message = (ended.reason, ended.message) if ended else (reason, message)
    conds = list(prev.conditions)

    def put(type_: str, status: bool | None, why: str, text: str) -> None:
        nonlocal conds
        conds = set_condition(conds, type_, status, why, text, now=now, generation=generation)

    if obs.gang_problem:
        put("Admitted", False, "SchedulerNotInstalled", obs.gang_problem)
    else:
        put("Admitted", True, "Admitted", f"gang scheduler: {spec.placement.gang.scheduler.value}")
    channel = obs.channel
    if channel is not None and channel.transport is not None:
        put(
            "WeightChannelReady",
            True,
            "TransportChosen",
            f"{channel.transport.value}: {channel.reason or ''}",
        )
    else:
        put(
            "WeightChannelReady",
            False,
            "NoTransport",
            (channel.reason if channel else None) or "waiting for pods",
        )
    if not spec.weight_sync.check_weight_update_equal:
        put("PreflightPassed", None, "NotRequested", "weightSync.checkWeightUpdateEqual is false")
    elif channel is not None and channel.preflight_passed is not None:
        pf = condition(channel.conditions, "PreflightPassed")
        put(
            "PreflightPassed",
            channel.preflight_passed,
            pf.reason if pf else "Reported",
            pf.message if pf else "",
        )
    else:
        put("PreflightPassed", None, "NotRun", "the check has not reported yet")
    degraded = phase == Phase.RUNNING and reason == "Running" and message != "all pods ready"
    problem = obs.progress_problem
    put(
        "Degraded",
        degraded or bool(problem),
        "Degraded" if degraded or problem else "Healthy",
        problem or (message if degraded else ""),
    )
    put("Progressing", phase == Phase.RUNNING, reason, message)
    put("Suspended", phase == Phase.SUSPENDED, "Suspended" if spec.suspend else "NotSuspended", "")
    put("Complete", phase == Phase.SUCCEEDED, reason if phase == Phase.SUCCEEDED else "NotComplete", "")
    put(
        "Failed",
        phase == Phase.FAILED,
        reason if phase == Phase.FAILED else "NotFailed",
        message if phase == Phase.FAILED else "",
    )
    progress = obs.progress
    return RLJobStatus(
        phase=phase,
        conditions=conds,
        observed_generation=generation,
        step=progress.step if progress else prev.step,
        weight_version=obs.pool.weight_version
        if obs.pool and obs.pool.weight_version is not None
        else prev.weight_version,
        reward=progress.reward if progress else prev.reward,
        staleness=progress.staleness if progress else prev.staleness,
        avg_staleness=progress.avg_staleness if progress else prev.avg_staleness,
        queue_size=progress.queue_size if progress else prev.queue_size,
        transport=channel.transport.value if channel and channel.transport else prev.transport,
        transport_reason=channel.reason if channel and channel.transport else prev.transport_reason,
        restarts=obs.trainer.restarts if obs.trainer else prev.restarts,
        start_time=prev.start_time or (now if phase == Phase.RUNNING else None),
        completion_time=prev.completion_time or (now if phase in TERMINAL else None),
    )


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
    min_replicas: int,
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
    conds = list(previous.conditions) if previous else []
    need = max(min_replicas, 1) if engines or min_replicas else 0
    conds = set_condition(
        conds,
        "Available",
        len(ready) >= need and need > 0,
        "ReadyReplicas",
        f"{len(ready)}/{len(engines)} engines ready",
        now=now,
        generation=generation,
    )
    conds = set_condition(
        conds,
        "MinAvailableBreached",
        len(ready) < min_replicas,
        "ReadyReplicas",
        f"{len(ready)} ready, minimum {min_replicas}",
        now=now,
        generation=generation,
    )
    conds = set_condition(
        conds,
        "WeightsSynced",
        not lagging if current_version is not None else None,
        "Versions" if current_version is not None else "NoVersionYet",
        f"engines behind version {current_version}: {', '.join(lagging)}" if lagging else "",
        now=now,
        generation=generation,
    )
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


def _up_to_date(
    conds: list[Condition], rolling: str | None, *, now: dt.datetime, generation: int | None
) -> list[Condition]:
    """Condition UpToDate: False (SpecChanged) while the gang restarts for a spec change; True after,
    keeping reason SpecChanged as the record of that restart (Current when there never was one)."""
    before = condition(conds, "UpToDate")
    if rolling is not None:
        message = (
            f"spec changed: restarting every rank with pod template {rolling} "
            "(not counted against the restart limit)"
        )
        return set_condition(conds, "UpToDate", False, "SpecChanged", message, now=now, generation=generation)
    if before is not None and before.status == ConditionStatus.TRUE:
        return conds
    rolled = before is not None and before.reason == "SpecChanged"
    reason = "SpecChanged" if rolled else "Current"
    message = (
        "every rank restarted for a spec change (not counted in restarts)"
        if rolled
        else "every rank runs the current pod template"
    )
    return set_condition(conds, "UpToDate", True, reason, message, now=now, generation=generation)


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
    conds = list(previous.conditions) if previous else []
    conds = _up_to_date(conds, rolling, now=now, generation=generation)
    conds = set_condition(
        conds,
        "Available",
        ready_pods == nodes,
        "ReadyRanks",
        f"{ready_pods}/{nodes} rank pods ready",
        now=now,
        generation=generation,
    )
    conds = set_condition(
        conds,
        "Degraded",
        ready_pods < nodes and restarts > 0,
        "GangRestart" if restarts else "Healthy",
        f"gang restarts: {restarts}" if restarts else "",
        now=now,
        generation=generation,
    )
    conds = set_condition(
        conds,
        "Failed",
        failed is not None,
        "GangRestartLimitExceeded" if failed else "NotFailed",
        failed or "",
        now=now,
        generation=generation,
    )
    return TrainerGroupStatus(
        world_size=nodes * gpus_per_node,
        ready_ranks=ready_pods * gpus_per_node,
        step=step,
        restarts=restarts,
        conditions=conds,
        observed_generation=generation,
    )


# ---------------------------------------------------------------------------------- WeightChannel


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
    reason = decision.reason if decision.transport or prev.transport is None else prev.reason
    conds = set_condition(
        prev.conditions,
        "Ready",
        transport is not None,
        "TransportChosen" if transport else "NoTransport",
        reason or "",
        now=now,
        generation=generation,
    )
    conds = set_condition(
        conds,
        "RequestedTransportFeasible",
        decision.override_rejected is None,
        "Infeasible" if decision.override_rejected else "Feasible",
        decision.override_rejected or "",
        now=now,
        generation=generation,
    )
    passed = prev.preflight_passed
    if progress is not None and progress.preflight is not None:
        passed = progress.preflight == "passed"
        names = ", ".join(progress.preflight_mismatched)
        message = "every tensor equal after the initial sync" if passed else f"tensors that differ: {names}"
        conds = set_condition(
            conds,
            "PreflightPassed",
            passed,
            "Equal" if passed else "Mismatch",
            message,
            now=now,
            generation=generation,
        )
    version = prev.weight_version
    current = progress.weight_version if progress is not None else None
    reported = {**progress.engine_versions, **(progress.engine_address_versions or {})} if progress else {}
    if current is not None and reported:
        version = current if all(v >= current for v in reported.values()) else version
    return WeightChannelStatus(
        transport=transport,
        reason=reason,
        weight_version=version,
        last_update_seconds=progress.last_update_seconds if progress else prev.last_update_seconds,
        wire_bytes=progress.wire_bytes if progress else prev.wire_bytes,
        last_update_time=prev.last_update_time if version == prev.weight_version else now,
        preflight_passed=passed,
        conditions=conds,
        observed_generation=generation,
    )
