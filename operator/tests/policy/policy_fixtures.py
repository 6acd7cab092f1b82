"""Builders shared by the policy table tests: a job spec from the fixtures and observed children."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import yaml
from lockstep.api.common import Condition, ConditionStatus
from lockstep.api.progress import ProgressReport
from lockstep.api.rljob import RLJob, RLJobSpec
from lockstep.api.rolloutpool import RolloutPoolStatus
from lockstep.api.trainergroup import TrainerGroupStatus
from lockstep.api.weightchannel import WeightChannelStatus
from lockstep_operator.policy.job_observed import JobObserved

FIXTURES = Path(__file__).parent.parent / "fixtures"
T0 = dt.datetime(2026, 12, 2, 10, 0, tzinfo=dt.UTC)


def job_spec(**spec: Any) -> RLJobSpec:
    """tiny-local.yaml (1 rank of 1 CPU, 1 engine) with top-level spec fields replaced."""
    raw = yaml.safe_load((FIXTURES / "tiny-local.yaml").read_text())
    raw["spec"].update(spec)
    return RLJob.model_validate(raw).spec


def cond(type_: str, status: bool, reason: str = "R", message: str = "") -> Condition:
    value = ConditionStatus.TRUE if status else ConditionStatus.FALSE
    return Condition(type=type_, status=value, reason=reason, message=message, last_transition_time=T0)


def seen(
    *,
    ranks: int | None = 1,
    engines: int | None = 1,
    driver: str | None = "Running",
    progress: ProgressReport | None = None,
    channel: WeightChannelStatus | None = None,
    trainer_failed: str | None = None,
    gang: str | None = None,
    problem: str | None = None,
    rank_reports: dict[int, ProgressReport] | None = None,
    init_failure: str | None = None,
    engine_init_failure: str | None = None,
) -> JobObserved:
    """Observed children: `ranks`/`engines` ready (None: the child does not exist yet)."""
    trainer = None
    if ranks is not None:
        failed = [cond("Failed", True, "GangRestartLimitExceeded", trainer_failed)] if trainer_failed else []
        trainer = TrainerGroupStatus(world_size=1, ready_ranks=ranks, conditions=failed)
    pool = RolloutPoolStatus(replicas=1, ready_replicas=engines) if engines is not None else None
    return JobObserved(
        pool,
        trainer,
        channel,
        progress,
        problem,
        driver,
        gang,
        rank_reports or {},
        init_failure,
        engine_init_failure,
    )
