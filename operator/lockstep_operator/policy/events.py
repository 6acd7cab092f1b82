"""Kubernetes Events of the four kinds: the stable reasons, and the events a status transition tells.

Why it exists: `kubectl describe rljob` should tell the story of a run (started, pods ready, running,
a rank failed and the gang restarted, an engine replaced, the pool scaled, succeeded) without reading
the operator's log. Events are derived here, purely, from what a reconcile pass decided: the status
before and after its single write (phase, conditions, transport), or an action it took (a gang
restart, a replaced engine). The reconciles collect them during a pass and post them after the status
write (k8s/events.py deduplicates and rate-limits). Reasons are an API: alerts and scripts match on
them, so a member of `Reason` is never renamed (docs/operator.md lists them).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lockstep.api.common import Condition, ConditionStatus
from lockstep.api.rljob import Phase, RLJobStatus
from lockstep.api.rolloutpool import RolloutPoolStatus
from lockstep.api.weightchannel import WeightChannelStatus

from lockstep_operator.policy.condition import condition

EventType = Literal["Normal", "Warning"]

RECONCILE_ERROR = "ReconcileError"
"""The condition type a failed pass sets on its object (reconcile/errors.py); removed once a pass of
that object succeeds. The RLJob also shows its children's (policy/reconcile_error.py)."""


class Reason(enum.StrEnum):
    """Every Event reason the operator posts (stable: never renamed)."""

    # RLJob phases (one event per transition)
    PENDING = "Pending"
    PROVISIONING = "Provisioning"
    PREFLIGHT = "Preflight"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    # RLJob conditions
    NOT_ADMITTED = "NotAdmitted"
    DEGRADED = "Degraded"
    RECOVERED = "Recovered"
    # WeightChannel (and the job, from its folded status)
    TRANSPORT_CHOSEN = "TransportChosen"
    TRANSPORT_INFEASIBLE = "RequestedTransportInfeasible"
    PREFLIGHT_PASSED = "PreflightPassed"
    PREFLIGHT_FAILED = "PreflightFailed"
    # TrainerGroup
    GANG_RESTART = "GangRestart"
    GANG_RESTART_LIMIT = "GangRestartLimitExceeded"
    GANG_ROLL = "GangRoll"
    GANG_ROLLED = "GangRolled"
    # RolloutPool
    ENGINE_REPLACED = "EngineReplaced"
    ENGINE_ROLLED = "EngineRolled"
    SCALED = "Scaled"
    ADAPTER_UNLOADED = "AdapterUnloaded"
    ADAPTER_UNLOAD_FAILED = "AdapterUnloadFailed"
    AUTOSCALED = "Autoscaled"
    WEIGHT_SYNC_LAGGING = "WeightSyncLagging"
    WEIGHTS_SYNCED = "WeightsSynced"
    # The driver pod
    DRIVER_REPLACED = "DriverReplaced"
    # Any kind: a pass that failed (a child refused by admission, quota, RBAC) and its end
    RECONCILE_ERROR = "ReconcileError"
    RECONCILED = "Reconciled"


@dataclass(frozen=True, slots=True)
class Event:
    """One event about an object, as a policy decided it."""

    type: EventType
    """Normal or Warning (kubectl describe shows both; Warning ones are what alerts watch)."""
    reason: Reason
    """A stable CamelCase reason."""
    message: str
    """What happened, naming the pod, rank or value concerned."""


def normal(reason: Reason, message: str) -> Event:
    """A Normal event."""
    return Event("Normal", reason, message)


def warning(reason: Reason, message: str) -> Event:
    """A Warning event."""
    return Event("Warning", reason, message)


def _became(before: Sequence[Condition], after: Sequence[Condition], type_: str) -> Condition | None:
    """The condition `type_` of `after` when its status differs from `before`'s (or it is new)."""
    new, old = condition(after, type_), condition(before, type_)
    if new is None or (old is not None and old.status == new.status):
        return None
    return new


def _true(cond: Condition | None) -> bool:
    return cond is not None and cond.status == ConditionStatus.TRUE


def _false(cond: Condition | None) -> bool:
    return cond is not None and cond.status == ConditionStatus.FALSE


def error_cleared(before: Sequence[Condition], after: Sequence[Condition]) -> list[Event]:
    """`Reconciled` when a ReconcileError condition went away (a pass of the object succeeded again)."""
    old = condition(before, RECONCILE_ERROR)
    if _true(old) and not _true(condition(after, RECONCILE_ERROR)):
        assert old is not None
        return [normal(Reason.RECONCILED, f"reconciled again after: {old.message}"[:1024])]
    return []


_PHASE_REASONS = {
    Phase.PENDING: Reason.PENDING,
    Phase.PROVISIONING: Reason.PROVISIONING,
    Phase.PREFLIGHT: Reason.PREFLIGHT,
    Phase.RUNNING: Reason.RUNNING,
    Phase.SUSPENDED: Reason.SUSPENDED,
    Phase.SUCCEEDED: Reason.SUCCEEDED,
    Phase.FAILED: Reason.FAILED,
}


def job_events(previous: RLJobStatus | None, new: RLJobStatus) -> list[Event]:
    """What the RLJob's status write tells: its phase, admission, degradation, transport, pre-flight."""
    prev = previous or RLJobStatus()
    before, after = prev.conditions, new.conditions
    events: list[Event] = []
    if new.phase is not None and new.phase != prev.phase:
        events.append(_phase_event(prev.phase, new))
    if _false(admitted := _became(before, after, "Admitted")):
        assert admitted is not None
        events.append(warning(Reason.NOT_ADMITTED, admitted.message))
    degraded = _became(before, after, "Degraded")
    if _true(degraded):
        assert degraded is not None
        events.append(warning(Reason.DEGRADED, degraded.message))
    elif _false(degraded) and _true(condition(before, "Degraded")):
        events.append(normal(Reason.RECOVERED, "every pod of the job is ready again"))
    if new.transport is not None and new.transport != prev.transport:
        events.append(normal(Reason.TRANSPORT_CHOSEN, f"{new.transport}: {new.transport_reason or ''}"))
    return events + preflight_events(before, after) + error_cleared(before, after)


def preflight_events(before: Sequence[Condition], after: Sequence[Condition]) -> list[Event]:
    """PreflightPassed became true or false: the job's and the WeightChannel's pre-flight verdict."""
    preflight = _became(before, after, "PreflightPassed")
    if _true(preflight):
        return [normal(Reason.PREFLIGHT_PASSED, "weights equal in every engine after the initial sync")]
    if _false(preflight):
        assert preflight is not None
        return [warning(Reason.PREFLIGHT_FAILED, preflight.message)]
    return []


def _phase_event(old: Phase | None, new: RLJobStatus) -> Event:
    phase = new.phase
    assert phase is not None
    if phase == Phase.FAILED:
        failed = condition(new.conditions, "Failed")
        why = f"{failed.reason}: {failed.message}" if failed is not None else "the job failed"
        return warning(Reason.FAILED, why)
    progressing = condition(new.conditions, "Progressing")
    detail = progressing.message if progressing is not None and progressing.message else ""
    if phase == Phase.SUCCEEDED:
        detail = f"finished at step {new.step}" if new.step is not None else "finished"
    if old == Phase.SUSPENDED and phase != Phase.SUSPENDED:
        return normal(Reason.RESUMED, f"spec.suspend is false: {phase.value}")
    return normal(_PHASE_REASONS[phase], detail or phase.value)


def channel_events(previous: WeightChannelStatus | None, new: WeightChannelStatus) -> list[Event]:
    """What the WeightChannel's status write tells: the transport chosen, a refused request, pre-flight."""
    prev = previous or WeightChannelStatus()
    before, after = prev.conditions, new.conditions
    events: list[Event] = []
    if new.transport is not None and new.transport != prev.transport:
        events.append(normal(Reason.TRANSPORT_CHOSEN, f"{new.transport.value}: {new.reason or ''}"))
    infeasible = _became(before, after, "RequestedTransportFeasible")
    if _false(infeasible):
        assert infeasible is not None
        events.append(warning(Reason.TRANSPORT_INFEASIBLE, infeasible.message))
    return events + preflight_events(before, after) + error_cleared(before, after)


def pool_events(
    previous: RolloutPoolStatus | None, new: RolloutPoolStatus, *, generation: int | None, replicas: int
) -> list[Event]:
    """What the RolloutPool's status write tells: a scale (spec.replicas changed since the last write,
    by /scale, the autoscaler or the job), weight sync lagging or caught up."""
    prev = previous or RolloutPoolStatus()
    events: list[Event] = []
    spec_changed = previous is not None and generation != prev.observed_generation
    if spec_changed and replicas != len(prev.engines):
        events.append(normal(Reason.SCALED, f"replicas {len(prev.engines)} -> {replicas}"))
    synced = _became(prev.conditions, new.conditions, "WeightsSynced")
    if _false(synced):
        assert synced is not None
        events.append(warning(Reason.WEIGHT_SYNC_LAGGING, synced.message))
    elif _true(synced) and _false(condition(prev.conditions, "WeightsSynced")):
        events.append(
            normal(Reason.WEIGHTS_SYNCED, f"every engine holds weight version {new.weight_version}")
        )
    return events + error_cleared(prev.conditions, new.conditions)


def trainer_events(
    before: Sequence[Condition],
    after: Sequence[Condition],
    *,
    restarts_before: int,
    restarts: int,
    limit: int,
    failed_before: bool,
    failed: str | None,
    broken: Sequence[str],
) -> list[Event]:
    """What a TrainerGroup pass decided: a counted gang restart (naming the failed rank), the restart
    limit reached, a roll for a spec change and its end. `broken`: why each failed rank failed."""
    events: list[Event] = []
    cause = broken[0] if broken else "a rank failed"
    if restarts > restarts_before:
        events.append(
            warning(Reason.GANG_RESTART, f"{cause}: restarting every rank (restart {restarts} of {limit})")
        )
    if failed is not None and not failed_before:
        events.append(warning(Reason.GANG_RESTART_LIMIT, failed))
    rolled = _became(before, after, "UpToDate")
    if _false(rolled):
        assert rolled is not None
        events.append(normal(Reason.GANG_ROLL, rolled.message))
    elif _true(rolled) and rolled is not None and rolled.reason == "SpecChanged":
        events.append(normal(Reason.GANG_ROLLED, rolled.message))
    return events + error_cleared(before, after)
