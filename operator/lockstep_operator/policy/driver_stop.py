"""Whether the driver pod of a job that must not run now is deleted (pure; table-tested).

Why: a job that is suspended or has failed must not keep a driver running (restartPolicy OnFailure
would restart it forever). But a job succeeds the moment its driver *reports* `done`; the driver then
still shuts the trainer group down and exits 0 on its own. Deleting it right then (found on the real
node) cut that shutdown short and lost the driver's logs with the pod, the only record of the run
`kubectl logs <job>-driver` has. So the driver of a Succeeded job gets DRIVER_EXIT_GRACE_S to exit;
one still running after that is deleted like any other.
"""

from __future__ import annotations

from lockstep.api.rljob import Phase

DRIVER_EXIT_GRACE_S = 120.0
"""How long the driver of a Succeeded job may take to exit by itself (seconds since completionTime)."""

ENDED = ("Succeeded", "Failed")
"""Pod phases of a driver that runs no more."""


def delete_driver(job_phase: Phase | None, driver_phase: str | None, completed_for_s: float | None) -> bool:
    """Whether to delete the driver pod of a job whose driver must not run (suspended or ended).

    `driver_phase`: the pod's phase (None: no pod); `completed_for_s`: seconds since the job's
    completionTime (None when unset).
    """
    if driver_phase is None or driver_phase in ENDED:
        return False  # nothing runs; an ended pod keeps its logs
    if job_phase is Phase.SUCCEEDED:
        return completed_for_s is None or completed_for_s >= DRIVER_EXIT_GRACE_S
    return True
