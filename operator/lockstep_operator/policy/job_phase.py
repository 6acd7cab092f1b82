"""A job's phase: Pending -> Provisioning -> Preflight -> Running -> Succeeded | Failed; Suspended.

Rules in order: a terminal phase is sticky; failure (job_failure), then success (job_success); a
suspended spec; children not created yet (Pending); a Running job stays Running while pods recover
(the reconcile shows it as Degraded); pods not ready (Provisioning); then Running once the pre-flight
check passed (when asked for) or the driver reported its init step, else Preflight. The deadline
(job_failure.deadline_exceeded) applies on top, in job_status.
"""

from __future__ import annotations

from lockstep.api.rljob import Phase, RLJobSpec, TrainingRecipe

from lockstep_operator.policy.job_failure import job_failure
from lockstep_operator.policy.job_observed import TERMINAL, JobObserved, Verdict
from lockstep_operator.policy.job_success import job_success


def needs_pool(spec: RLJobSpec) -> bool:
    """Whether the job samples on a RolloutPool: every RL job; an SFT job (spec.recipe sft) has none."""
    return spec.recipe is not TrainingRecipe.SFT


def pods_ready(spec: RLJobSpec, obs: JobObserved) -> tuple[bool, str]:
    """Whether every pod the job needs is ready (all ranks, the pool's min_available engines, each
    teacher pool's engines, the driver), and if not what is missing."""
    missing = []
    want_ranks = spec.trainer.nodes * spec.trainer.gpus_per_node
    if obs.trainer is None or obs.trainer.ready_ranks < want_ranks:
        have = obs.trainer.ready_ranks if obs.trainer else 0
        missing.append(f"trainer ranks ready {have}/{want_ranks}")
    if needs_pool(spec):
        want_engines = spec.rollout.min_available
        if obs.pool is None or obs.pool.ready_replicas < want_engines:
            have = obs.pool.ready_replicas if obs.pool else 0
            missing.append(f"engines ready {have}/{want_engines}")
    for name, teacher in sorted(obs.teacher_pools.items()):
        want = teacher.replicas if teacher is not None else 1
        have = teacher.ready_replicas if teacher is not None else 0
        if teacher is None or have < max(want, 1):
            missing.append(f"teacher {name} engines ready {have}/{max(want, 1)}")
    if obs.driver_phase != "Running":
        missing.append(f"driver {obs.driver_phase or 'not created'}")
    return not missing, "; ".join(missing)


def job_phase(spec: RLJobSpec, obs: JobObserved, previous: Phase | None) -> Verdict:
    """The phase for what was observed, before the deadline rule."""
    if previous in TERMINAL:
        return Verdict(previous, "Terminal", f"job {previous.value.lower()}")
    ended = job_failure(obs, spec.backoff_limit) or job_success(spec, obs)
    if ended is not None:
        return ended
    if spec.suspend:
        return Verdict(Phase.SUSPENDED, "Suspended", "spec.suspend is true: pods scaled to zero")
    if obs.missing_pool:
        return Verdict(Phase.PENDING, obs.missing_pool_reason, obs.missing_pool)
    if (needs_pool(spec) and obs.pool is None) or obs.trainer is None:
        what = "the pool, trainer group and weight channel" if needs_pool(spec) else "the trainer group"
        return Verdict(Phase.PENDING, "CreatingChildren", f"creating {what}")
    ready, missing = pods_ready(spec, obs)
    if previous == Phase.RUNNING:
        return Verdict(Phase.RUNNING, "Running", missing or "all pods ready")
    if not ready:
        return Verdict(Phase.PROVISIONING, "WaitingForPods", missing)
    if spec.weight_sync.check_weight_update_equal:
        if obs.channel is not None and obs.channel.preflight_passed:
            return Verdict(Phase.RUNNING, "PreflightPassed", "weight-equality check passed")
        return Verdict(Phase.PREFLIGHT, "PreflightRunning", "waiting for the weight-equality check")
    if obs.progress is not None and obs.progress.step is not None:
        return Verdict(Phase.RUNNING, "Initialized", "the driver finished its init step")
    return Verdict(
        Phase.PREFLIGHT, "Initializing", "waiting for the driver's init step (initial weight sync)"
    )
