"""The RLJob's conditions, one named pure function each; `job_conditions` lists them in order.

Admitted (the gang scheduler is usable), WeightChannelReady (a transport is chosen), PreflightPassed
(the weight-equality check, Unknown when not requested or not run), Degraded (Running with pods
missing, an unreadable progress document, or a run that trains nothing), Progressing (Running),
Suspended, Complete, Failed.
"""

from __future__ import annotations

from lockstep.api.rljob import Phase, RLJobSpec, TrainingRecipe

from lockstep_operator.policy.condition import Update, condition
from lockstep_operator.policy.job_observed import TERMINAL, JobObserved, Verdict


def admitted(spec: RLJobSpec, obs: JobObserved) -> Update:
    """False naming what to create while a pool the job names does not exist (or why the pool cannot take
    its adapter name yet), or what to install while the gang scheduler's API is not served."""
    if obs.missing_pool:
        return Update("Admitted", False, obs.missing_pool_reason, obs.missing_pool)
    if obs.gang_problem:
        return Update("Admitted", False, "SchedulerNotInstalled", obs.gang_problem)
    return Update("Admitted", True, "Admitted", f"gang scheduler: {spec.placement.gang.scheduler.value}")


def weight_channel_ready(obs: JobObserved, spec: RLJobSpec | None = None) -> Update:
    """True once the WeightChannel chose a transport (with its reason); Unknown for an SFT job, which
    has no engines and no channel."""
    if spec is not None and spec.recipe is TrainingRecipe.SFT:
        return Update(
            "WeightChannelReady", None, "NoEngines", "an sft job has no engines and no weight channel"
        )
    channel = obs.channel
    if channel is not None and channel.transport is not None:
        return Update(
            "WeightChannelReady",
            True,
            "TransportChosen",
            f"{channel.transport.value}: {channel.reason or ''}",
        )
    why = (channel.reason if channel else None) or "waiting for pods"
    return Update("WeightChannelReady", False, "NoTransport", why)


def preflight_passed(spec: RLJobSpec, obs: JobObserved) -> Update:
    """The channel's PreflightPassed; Unknown when the check is off or has not reported."""
    channel = obs.channel
    if not spec.weight_sync.check_weight_update_equal:
        return Update("PreflightPassed", None, "NotRequested", "weightSync.checkWeightUpdateEqual is false")
    if channel is None or channel.preflight_passed is None:
        return Update("PreflightPassed", None, "NotRun", "the check has not reported yet")
    reported = condition(channel.conditions, "PreflightPassed")
    reason, message = (reported.reason, reported.message) if reported else ("Reported", "")
    return Update("PreflightPassed", channel.preflight_passed, reason, message)


def degraded(verdict: Verdict, obs: JobObserved) -> Update:
    """True while a Running job misses pods (the verdict's message says which), the progress
    document is unreadable, or the driver reports that the run trains nothing (reason
    NoTrainedTokens: steps in a row without a trained token)."""
    missing = (
        verdict.phase == Phase.RUNNING and verdict.reason == "Running" and verdict.message != "all pods ready"
    )
    problem = obs.progress_problem
    untrained = obs.progress.degraded if obs.progress is not None and verdict.phase not in TERMINAL else None
    if untrained and not missing and not problem:
        return Update("Degraded", True, "NoTrainedTokens", untrained)
    if not missing and not problem:
        return Update("Degraded", False, "Healthy", "")
    return Update("Degraded", True, "Degraded", problem or verdict.message)


def progressing(verdict: Verdict) -> Update:
    """True while Running; the phase's reason and message either way."""
    return Update("Progressing", verdict.phase == Phase.RUNNING, verdict.reason, verdict.message)


def suspended(spec: RLJobSpec, verdict: Verdict) -> Update:
    """True while the job is Suspended."""
    return Update(
        "Suspended", verdict.phase == Phase.SUSPENDED, "Suspended" if spec.suspend else "NotSuspended"
    )


def complete(verdict: Verdict) -> Update:
    """True once Succeeded, with the reason it ended with."""
    done = verdict.phase == Phase.SUCCEEDED
    return Update("Complete", done, verdict.reason if done else "NotComplete")


def failed(verdict: Verdict) -> Update:
    """True once Failed, with the reason and message it ended with."""
    if verdict.phase != Phase.FAILED:
        return Update("Failed", False, "NotFailed")
    return Update("Failed", True, verdict.reason, verdict.message)


def job_conditions(spec: RLJobSpec, obs: JobObserved, verdict: Verdict) -> list[Update]:
    """Every condition of the job for this verdict, in the order they are listed in status."""
    return [
        admitted(spec, obs),
        weight_channel_ready(obs, spec),
        preflight_passed(spec, obs),
        degraded(verdict, obs),
        progressing(verdict),
        suspended(spec, verdict),
        complete(verdict),
        failed(verdict),
    ]
