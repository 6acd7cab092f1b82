"""Table tests of every condition policy: job, trainer group, rolloutpool and weight channel."""

from __future__ import annotations

import pytest
from lockstep.api.progress import ProgressReport
from lockstep.api.rljob import Phase, Transport
from lockstep.api.weightchannel import WeightChannelStatus
from lockstep_operator.policy import channel_conditions, job_conditions, pool_conditions, trainer_conditions
from lockstep_operator.policy.condition import Update
from lockstep_operator.policy.job_observed import Verdict
from policy_fixtures import cond, job_spec, seen

RUNNING_OK = Verdict(Phase.RUNNING, "Running", "all pods ready")
RUNNING_MISSING = Verdict(Phase.RUNNING, "Running", "engines ready 0/1")
FAILED = Verdict(Phase.FAILED, "DriverFailed", "the driver pod failed")
DONE = Verdict(Phase.SUCCEEDED, "Completed", "all 4 steps done")
CHOSEN = WeightChannelStatus(transport=Transport.BROADCAST, reason="one network")
CHECKED = WeightChannelStatus(
    preflight_passed=False, conditions=[cond("PreflightPassed", False, "Mismatch", "w1")]
)
NO_CHECK = {"weightSync": {"checkWeightUpdateEqual": False}}
UNTRAINED = ProgressReport(step=5, degraded="3 steps in a row trained no token")

JOB: list[tuple[str, Update, Update]] = [
    (
        "admitted",
        job_conditions.admitted(job_spec(), seen()),
        Update("Admitted", True, "Admitted", "gang scheduler: none"),
    ),
    (
        "not admitted",
        job_conditions.admitted(job_spec(), seen(gang="install volcano")),
        Update("Admitted", False, "SchedulerNotInstalled", "install volcano"),
    ),
    (
        "channel chosen",
        job_conditions.weight_channel_ready(seen(channel=CHOSEN)),
        Update("WeightChannelReady", True, "TransportChosen", "broadcast: one network"),
    ),
    (
        "channel waiting",
        job_conditions.weight_channel_ready(seen()),
        Update("WeightChannelReady", False, "NoTransport", "waiting for pods"),
    ),
    (
        "preflight off",
        job_conditions.preflight_passed(job_spec(**NO_CHECK), seen()),
        Update("PreflightPassed", None, "NotRequested", "weightSync.checkWeightUpdateEqual is false"),
    ),
    (
        "preflight not run",
        job_conditions.preflight_passed(job_spec(), seen()),
        Update("PreflightPassed", None, "NotRun", "the check has not reported yet"),
    ),
    (
        "preflight failed",
        job_conditions.preflight_passed(job_spec(), seen(channel=CHECKED)),
        Update("PreflightPassed", False, "Mismatch", "w1"),
    ),
    ("healthy", job_conditions.degraded(RUNNING_OK, seen()), Update("Degraded", False, "Healthy", "")),
    (
        "pods missing",
        job_conditions.degraded(RUNNING_MISSING, seen()),
        Update("Degraded", True, "Degraded", "engines ready 0/1"),
    ),
    (
        "bad progress",
        job_conditions.degraded(RUNNING_OK, seen(problem="not JSON")),
        Update("Degraded", True, "Degraded", "not JSON"),
    ),
    (
        "trains nothing",
        job_conditions.degraded(RUNNING_OK, seen(progress=UNTRAINED)),
        Update("Degraded", True, "NoTrainedTokens", "3 steps in a row trained no token"),
    ),
    (
        "pods missing outrank it",
        job_conditions.degraded(RUNNING_MISSING, seen(progress=UNTRAINED)),
        Update("Degraded", True, "Degraded", "engines ready 0/1"),
    ),
    (
        "a failed job is not degraded",
        job_conditions.degraded(FAILED, seen(progress=UNTRAINED)),
        Update("Degraded", False, "Healthy", ""),
    ),
    (
        "progressing",
        job_conditions.progressing(RUNNING_OK),
        Update("Progressing", True, "Running", "all pods ready"),
    ),
    (
        "not progressing",
        job_conditions.progressing(FAILED),
        Update("Progressing", False, "DriverFailed", "the driver pod failed"),
    ),
    (
        "suspended",
        job_conditions.suspended(job_spec(suspend=True), Verdict(Phase.SUSPENDED, "Suspended", "")),
        Update("Suspended", True, "Suspended"),
    ),
    (
        "not suspended",
        job_conditions.suspended(job_spec(), RUNNING_OK),
        Update("Suspended", False, "NotSuspended"),
    ),
    ("complete", job_conditions.complete(DONE), Update("Complete", True, "Completed")),
    ("not complete", job_conditions.complete(RUNNING_OK), Update("Complete", False, "NotComplete")),
    (
        "failed",
        job_conditions.failed(FAILED),
        Update("Failed", True, "DriverFailed", "the driver pod failed"),
    ),
    ("not failed", job_conditions.failed(DONE), Update("Failed", False, "NotFailed")),
]

BEFORE_ROLL = cond("UpToDate", False, "SpecChanged")
TRAINER: list[tuple[str, Update | None, Update | None]] = [
    (
        "rolling",
        trainer_conditions.up_to_date(None, "abc"),
        Update(
            "UpToDate",
            False,
            "SpecChanged",
            "spec changed: restarting every rank with pod template abc (not counted against the restart limit)",
        ),
    ),
    (
        "rolled",
        trainer_conditions.up_to_date(BEFORE_ROLL, None),
        Update(
            "UpToDate",
            True,
            "SpecChanged",
            "every rank restarted for a spec change (not counted in restarts)",
        ),
    ),
    (
        "current",
        trainer_conditions.up_to_date(None, None),
        Update("UpToDate", True, "Current", "every rank runs the current pod template"),
    ),
    ("kept", trainer_conditions.up_to_date(cond("UpToDate", True), None), None),
    (
        "available",
        trainer_conditions.available(2, 2),
        Update("Available", True, "ReadyRanks", "2/2 rank pods ready"),
    ),
    (
        "unavailable",
        trainer_conditions.available(1, 2),
        Update("Available", False, "ReadyRanks", "1/2 rank pods ready"),
    ),
    ("never restarted", trainer_conditions.degraded(0, 2, 0), Update("Degraded", False, "Healthy", "")),
    (
        "restarting",
        trainer_conditions.degraded(1, 2, 1),
        Update("Degraded", True, "GangRestart", "gang restarts: 1"),
    ),
    (
        "recovered",
        trainer_conditions.degraded(2, 2, 1),
        Update("Degraded", False, "GangRestart", "gang restarts: 1"),
    ),
    (
        "failed",
        trainer_conditions.failed("rank 1 OOM"),
        Update("Failed", True, "GangRestartLimitExceeded", "rank 1 OOM"),
    ),
    ("not failed", trainer_conditions.failed(None), Update("Failed", False, "NotFailed", "")),
]

POOL: list[tuple[str, Update, Update]] = [
    (
        "available",
        pool_conditions.available(2, 3, 2),
        Update("Available", True, "ReadyReplicas", "2/3 engines ready"),
    ),
    (
        "minimum not met",
        pool_conditions.available(1, 3, 2),
        Update("Available", False, "ReadyReplicas", "1/3 engines ready"),
    ),
    (
        "empty pool",
        pool_conditions.available(0, 0, 0),
        Update("Available", False, "ReadyReplicas", "0/0 engines ready"),
    ),
    (
        "one needed at min 0",
        pool_conditions.available(0, 2, 0),
        Update("Available", False, "ReadyReplicas", "0/2 engines ready"),
    ),
    (
        "breached",
        pool_conditions.min_available_breached(1, 2),
        Update("MinAvailableBreached", True, "ReadyReplicas", "1 ready, minimum 2"),
    ),
    (
        "not breached",
        pool_conditions.min_available_breached(2, 2),
        Update("MinAvailableBreached", False, "ReadyReplicas", "2 ready, minimum 2"),
    ),
    (
        "no version yet",
        pool_conditions.weights_synced(None, []),
        Update("WeightsSynced", None, "NoVersionYet", ""),
    ),
    ("synced", pool_conditions.weights_synced(3, []), Update("WeightsSynced", True, "Versions", "")),
    (
        "behind",
        pool_conditions.weights_synced(3, ["p-1"]),
        Update("WeightsSynced", False, "Versions", "engines behind version 3: p-1"),
    ),
]

CHANNEL: list[tuple[str, Update, Update]] = [
    (
        "ready",
        channel_conditions.ready(True, "one network"),
        Update("Ready", True, "TransportChosen", "one network"),
    ),
    ("not ready", channel_conditions.ready(False, None), Update("Ready", False, "NoTransport", "")),
    (
        "feasible",
        channel_conditions.requested_transport_feasible(None),
        Update("RequestedTransportFeasible", True, "Feasible", ""),
    ),
    (
        "infeasible",
        channel_conditions.requested_transport_feasible("no RDMA"),
        Update("RequestedTransportFeasible", False, "Infeasible", "no RDMA"),
    ),
    (
        "equal",
        channel_conditions.preflight_passed(True, []),
        Update("PreflightPassed", True, "Equal", "every tensor equal after the initial sync"),
    ),
    (
        "mismatch",
        channel_conditions.preflight_passed(False, ["a", "b"]),
        Update("PreflightPassed", False, "Mismatch", "tensors that differ: a, b"),
    ),
]
ALL = [("job " + c[0], *c[1:]) for c in JOB] + [("trainer " + c[0], *c[1:]) for c in TRAINER]
ALL += [("pool " + c[0], *c[1:]) for c in POOL] + [("channel " + c[0], *c[1:]) for c in CHANNEL]


@pytest.mark.parametrize(("got", "want"), [c[1:] for c in ALL], ids=[c[0] for c in ALL])
def test_condition_table(got: Update | None, want: Update | None) -> None:
    assert got == want


def test_job_conditions_are_listed_in_status_order() -> None:
    updates = job_conditions.job_conditions(job_spec(), seen(), RUNNING_OK)
    assert [u.type for u in updates] == [
        "Admitted", "WeightChannelReady", "PreflightPassed", "Degraded", "Progressing", "Suspended", "Complete", "Failed",
    ]  # fmt: skip
