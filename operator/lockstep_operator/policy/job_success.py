"""When a job has succeeded (the job's success policy; JobSet's success_policy.go is the model).

The driver is the only one who knows every step ran: a progress report with `done` succeeds the job.
"""

from __future__ import annotations

from lockstep.api.rljob import Phase, RLJobSpec

from lockstep_operator.policy.job_observed import JobObserved, Verdict


def job_success(spec: RLJobSpec, obs: JobObserved) -> Verdict | None:
    """The Succeeded verdict once the driver reported `done`, or None."""
    if obs.progress is not None and obs.progress.done:
        return Verdict(Phase.SUCCEEDED, "Completed", f"all {spec.schedule.steps} steps done")
    return None
