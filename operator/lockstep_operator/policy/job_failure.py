"""When a job has failed, and why (the job's failure policy; JobSet's failure_policy.go is the model).

Rules in order, the first that matches wins: the trainer group failed (its gang restart limit was
reached: its reason and message), a trainer rank reported that it cannot start (the lowest such
rank's error: TrainerStartFailed), the pre-flight weight-equality check failed (the tensors that
differ), the driver reported a fatal error (DriverStartFailed when it could not start, else
DriverError), an init step of the driver pod failed (the model download: ModelPullFailed), an init
step of an engine pod failed (the download: ModelPullFailed; the low-precision conversion:
ServingCheckpointFailed), the driver pod crash-looped (more restarts than spec.backoffLimit:
DriverCrashLoop, with its last exit; OnFailure would otherwise restart it for ever, the job stuck in
Preflight or Running with no reason), the driver pod failed. Separately, a job running longer
than spec.activeDeadlineSeconds fails with DeadlineExceeded.
"""

from __future__ import annotations

import datetime as dt

from lockstep.api.common import ConditionStatus
from lockstep.api.rljob import Phase, RLJobSpec

from lockstep_operator.policy.condition import condition
from lockstep_operator.policy.job_observed import JobObserved, Verdict


def job_failure(obs: JobObserved, driver_restart_limit: int) -> Verdict | None:
    """The Failed verdict for what the children and the driver report, or None.
    `driver_restart_limit`: the driver container restarts allowed (spec.backoffLimit)."""
    failed = condition(obs.trainer.conditions, "Failed") if obs.trainer is not None else None
    if failed is not None and failed.status == ConditionStatus.TRUE:
        return Verdict(Phase.FAILED, failed.reason, f"trainer: {failed.message}")
    rank = next((r for _, r in sorted(obs.rank_reports.items()) if r.error), None)
    if rank is not None and rank.error:
        return Verdict(Phase.FAILED, rank.reason or "TrainerStartFailed", rank.error)
    progress = obs.progress
    if progress is not None and progress.preflight == "failed":
        names = ", ".join(progress.preflight_mismatched) or "(not named by the driver)"
        return Verdict(
            Phase.FAILED, "PreflightFailed", f"weight-equality check failed; tensors that differ: {names}"
        )
    if progress is not None and progress.error:
        return Verdict(Phase.FAILED, progress.reason or "DriverError", progress.error)
    if obs.driver_init_failure is not None:
        return Verdict(Phase.FAILED, "ModelPullFailed", f"driver pod: {obs.driver_init_failure}")
    if obs.engine_init_failure is not None:
        step = obs.engine_init_failure.split(": ", 1)[-1]
        reason = "ServingCheckpointFailed" if step.startswith("convert-model") else "ModelPullFailed"
        return Verdict(Phase.FAILED, reason, f"engine pod {obs.engine_init_failure}")
    if obs.driver_restarts > driver_restart_limit:
        last = f"; last run {obs.driver_last_exit}" if obs.driver_last_exit else ""
        return Verdict(
            Phase.FAILED,
            "DriverCrashLoop",
            f"the driver restarted {obs.driver_restarts} times, more than backoffLimit={driver_restart_limit}"
            f"{last} (the crashed run's log: kubectl logs --previous on the driver pod)",
        )
    if obs.driver_phase == "Failed":
        return Verdict(Phase.FAILED, "DriverFailed", "the driver pod failed")
    return None


def deadline_exceeded(spec: RLJobSpec, start_time: dt.datetime | None, now: dt.datetime) -> Verdict | None:
    """Failed with DeadlineExceeded once the job ran longer than spec.activeDeadlineSeconds."""
    deadline = spec.active_deadline_seconds
    if not deadline or start_time is None or (now - start_time).total_seconds() <= deadline:
        return None
    return Verdict(Phase.FAILED, "DeadlineExceeded", f"running longer than activeDeadlineSeconds={deadline}")
