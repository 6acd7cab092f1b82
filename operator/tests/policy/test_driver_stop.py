"""delete_driver: the driver of a Succeeded job may finish by itself; a suspended or failed job's goes."""

from __future__ import annotations

import pytest
from lockstep.api.rljob import Phase
from lockstep_operator.policy.driver_stop import DRIVER_EXIT_GRACE_S, delete_driver


@pytest.mark.parametrize(
    ("job_phase", "driver_phase", "completed_for_s", "want"),
    [
        (Phase.SUCCEEDED, "Running", 1.0, False),  # it reported done and is shutting the trainer down
        (Phase.SUCCEEDED, "Running", DRIVER_EXIT_GRACE_S, True),  # hung after done
        (Phase.SUCCEEDED, "Running", None, True),  # no completion time: nothing to wait for
        (Phase.SUCCEEDED, "Succeeded", 1.0, False),  # ended: keep its logs
        (Phase.FAILED, "Running", 1.0, True),  # OnFailure would restart it forever
        (Phase.FAILED, "Failed", 1.0, False),
        (Phase.SUSPENDED, "Running", None, True),
        (Phase.SUSPENDED, "Pending", None, True),
        (Phase.SUSPENDED, None, None, False),  # no pod
    ],
    ids=[
        "succeeded-exiting", "succeeded-hung", "succeeded-no-time", "succeeded-ended", "failed-running",
        "failed-ended", "suspended-running", "suspended-pending", "no-pod",
    ],
)  # fmt: skip
def test_delete_driver_table(
    job_phase: Phase, driver_phase: str | None, completed_for_s: float | None, want: bool
) -> None:
    assert delete_driver(job_phase, driver_phase, completed_for_s) is want
