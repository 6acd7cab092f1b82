"""What the RLJob reconcile observed about its children: the input of every job policy."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lockstep.api.progress import ProgressReport
from lockstep.api.rljob import Phase
from lockstep.api.rolloutpool import RolloutPoolStatus
from lockstep.api.trainergroup import TrainerGroupStatus
from lockstep.api.weightchannel import WeightChannelStatus

TERMINAL = (Phase.SUCCEEDED, Phase.FAILED)
"""Phases a job never leaves."""


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
    rank_reports: Mapping[int, ProgressReport] = field(default_factory=dict)
    """Trainer rank -> its document in the progress channel (written only when it cannot start)."""
    driver_init_failure: str | None = None
    """Why an init step of the driver pod (pull-model) failed, if one did (init_failure)."""
    engine_init_failure: str | None = None
    """`<pod>: <init_failure>` of the first engine pod whose init step (pull-model, convert-model)
    failed; the pool keeps such a pod instead of replacing it, so the reason stays readable."""
    teacher_pools: Mapping[str, RolloutPoolStatus | None] = field(default_factory=dict)
    """On-policy distillation: the status of each teacher pool the job reads (its own and the standalone
    ones its teachers name), by pool name (None before it reports)."""
    driver_restarts: int = 0
    """Restarts of the driver pod's container (restartPolicy OnFailure: a crashed driver resumes)."""
    driver_last_exit: str | None = None
    """`exited <code>: <termination message>` of the driver container's last failed run (main_restarts)."""
    missing_pool: str | None = None
    """Why the job waits for a standalone RolloutPool it names (rollout.poolRef, a teacher's poolRef):
    the pool does not exist yet (what to create), or it cannot take this job's adapter name yet.
    Nothing of the job is created meanwhile."""
    missing_pool_reason: str = "PoolNotFound"
    """The reason of that wait (policy.pool_ref.PoolRefProblem.reason)."""


def init_failure(pod: Mapping[str, Any] | None) -> str | None:
    """`<container> exited <code>: <termination message>` of the first init container of `pod` that
    ended non-zero, now or before its restart; None when none did (pure)."""
    for st in ((pod or {}).get("status") or {}).get("initContainerStatuses") or []:
        for state in (st.get("state") or {}, st.get("lastState") or {}):
            ended = state.get("terminated") or {}
            if ended.get("exitCode"):
                message = (ended.get("message") or ended.get("reason") or "").strip()
                return f"{st.get('name')} exited {ended['exitCode']}: {message[-1000:]}"
    return None


def main_restarts(pod: Mapping[str, Any] | None) -> tuple[int, str | None]:
    """(restarts, `exited <code>: <termination message>` of its last non-zero exit) of the first
    container of `pod`; (0, None) without a pod (pure)."""
    statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
    if not statuses:
        return 0, None
    st = statuses[0]
    ended = (st.get("lastState") or {}).get("terminated") or (st.get("state") or {}).get("terminated") or {}
    last = None
    if ended.get("exitCode"):
        message = (ended.get("message") or ended.get("reason") or "").strip()
        last = f"exited {ended['exitCode']}: {message[-1000:]}"
    return int(st.get("restartCount") or 0), last


@dataclass(frozen=True, slots=True)
class Verdict:
    """A phase with the reason and message it is shown with."""

    phase: Phase
    """The job's phase."""
    reason: str
    """CamelCase reason (also the reason of Progressing, Complete or Failed)."""
    message: str
    """Human-readable detail."""
