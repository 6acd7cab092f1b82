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


@dataclass(frozen=True, slots=True)
class Verdict:
    """A phase with the reason and message it is shown with."""

    phase: Phase
    """The job's phase."""
    reason: str
    """CamelCase reason (also the reason of Progressing, Complete or Failed)."""
    message: str
    """Human-readable detail."""
