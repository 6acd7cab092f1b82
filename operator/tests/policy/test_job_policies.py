"""Table tests of the job's failure, success and phase policies (policy/job_*.py)."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import pytest
from lockstep.api.progress import ProgressReport
from lockstep.api.rljob import Phase
from lockstep.api.weightchannel import WeightChannelStatus
from lockstep_operator.policy.job_failure import deadline_exceeded, job_failure
from lockstep_operator.policy.job_observed import JobObserved, init_failure, main_restarts
from lockstep_operator.policy.job_phase import job_phase
from lockstep_operator.policy.job_success import job_success
from policy_fixtures import T0, job_spec, seen

FAILURES: list[tuple[str, JobObserved, tuple[str, str] | None]] = [
    ("healthy", seen(), None),
    (
        "trainer failed",
        seen(trainer_failed="rank 0 OOMKilled"),
        ("GangRestartLimitExceeded", "trainer: rank 0 OOMKilled"),
    ),
    (
        "preflight failed",
        seen(progress=ProgressReport(preflight="failed", preflight_mismatched=["w1", "w2"])),
        ("PreflightFailed", "weight-equality check failed; tensors that differ: w1, w2"),
    ),
    (
        "preflight failed unnamed",
        seen(progress=ProgressReport(preflight="failed")),
        ("PreflightFailed", "weight-equality check failed; tensors that differ: (not named by the driver)"),
    ),
    (
        "driver error",
        seen(progress=ProgressReport(error="non-finite loss")),
        ("DriverError", "non-finite loss"),
    ),
    (
        "driver could not start",
        seen(
            progress=ProgressReport(
                error="driver could not start: FileNotFoundError: /models/x", reason="DriverStartFailed"
            ),
            driver="Running",
        ),
        ("DriverStartFailed", "driver could not start: FileNotFoundError: /models/x"),
    ),
    (
        "trainer rank could not start: the lowest failed rank",
        seen(
            rank_reports={
                3: ProgressReport(error="trainer rank 3 could not start: b", reason="TrainerStartFailed"),
                1: ProgressReport(error="trainer rank 1 could not start: a", reason="TrainerStartFailed"),
                0: ProgressReport(),
            },
            progress=ProgressReport(error="later", reason="DriverStartFailed"),
        ),
        ("TrainerStartFailed", "trainer rank 1 could not start: a"),
    ),
    (
        "rank report without a reason",
        seen(rank_reports={0: ProgressReport(error="x")}),
        ("TrainerStartFailed", "x"),
    ),
    ("rank report without an error", seen(rank_reports={0: ProgressReport()}), None),
    (
        "model download failed",
        seen(driver="Pending", init_failure="pull-model exited 2: error: Qwen/Qwen3-4B: hub unreachable"),
        ("ModelPullFailed", "driver pod: pull-model exited 2: error: Qwen/Qwen3-4B: hub unreachable"),
    ),
    (
        "serving checkpoint conversion failed",
        seen(
            engine_init_failure="j-rollout-0: convert-model exited 2: error: SRC /models/x: not an HF-layout"
        ),
        (
            "ServingCheckpointFailed",
            "engine pod j-rollout-0: convert-model exited 2: error: SRC /models/x: not an HF-layout",
        ),
    ),
    (
        "an engine's model download failed",
        seen(engine_init_failure="j-rollout-1: pull-model exited 2: error: hub unreachable"),
        ("ModelPullFailed", "engine pod j-rollout-1: pull-model exited 2: error: hub unreachable"),
    ),
    (
        "the driver's download names the driver first",
        seen(
            init_failure="pull-model exited 2: a", engine_init_failure="j-rollout-0: pull-model exited 2: a"
        ),
        ("ModelPullFailed", "driver pod: pull-model exited 2: a"),
    ),
    ("driver pod failed", seen(driver="Failed"), ("DriverFailed", "the driver pod failed")),
    ("driver restarted up to the limit", dataclasses.replace(seen(), driver_restarts=3), None),
    (
        "driver crash loop",
        dataclasses.replace(seen(), driver_restarts=4, driver_last_exit="exited 1: ValueError: version 0"),
        (
            "DriverCrashLoop",
            "the driver restarted 4 times, more than backoffLimit=3; last run exited 1: ValueError: version 0"
            " (the crashed run's log: kubectl logs --previous on the driver pod)",
        ),
    ),
    (
        "trainer wins over driver",
        seen(trainer_failed="x", driver="Failed"),
        ("GangRestartLimitExceeded", "trainer: x"),
    ),
]


@pytest.mark.parametrize(("obs", "want"), [c[1:] for c in FAILURES], ids=[c[0] for c in FAILURES])
def test_job_failure_table(obs: JobObserved, want: tuple[str, str] | None) -> None:
    verdict = job_failure(obs, driver_restart_limit=3)
    assert (None if verdict is None else (verdict.reason, verdict.message)) == want
    assert verdict is None or verdict.phase == Phase.FAILED


MAIN_RESTARTS: list[tuple[str, dict[str, Any] | None, tuple[int, str | None]]] = [
    ("no pod", None, (0, None)),
    ("not started", {"status": {}}, (0, None)),
    ("running, never restarted", {"status": {"containerStatuses": [{"restartCount": 0, "state": {"running": {}}}]}},
     (0, None)),
    ("restarted after a crash", {"status": {"containerStatuses": [{
        "restartCount": 2, "state": {"running": {}},
        "lastState": {"terminated": {"exitCode": 1, "message": "boom\n"}}}]}}, (2, "exited 1: boom")),
    ("ended non-zero, not restarted yet", {"status": {"containerStatuses": [{
        "restartCount": 0, "state": {"terminated": {"exitCode": 6, "reason": "Error"}}}]}}, (0, "exited 6: Error")),
    ("a clean exit is no failure", {"status": {"containerStatuses": [{
        "restartCount": 1, "lastState": {"terminated": {"exitCode": 0}}}]}}, (1, None)),
]  # fmt: skip


@pytest.mark.parametrize(("pod", "want"), [c[1:] for c in MAIN_RESTARTS], ids=[c[0] for c in MAIN_RESTARTS])
def test_main_restarts_table(pod: dict[str, Any] | None, want: tuple[int, str | None]) -> None:
    assert main_restarts(pod) == want


@pytest.mark.parametrize(
    ("deadline", "started", "elapsed_s", "exceeded"),
    [(None, T0, 10**6, False), (60, None, 10**6, False), (60, T0, 60, False), (60, T0, 61, True)],
    ids=["no-deadline", "not-started", "at-deadline", "past-deadline"],
)
def test_deadline_table(
    deadline: int | None, started: dt.datetime | None, elapsed_s: int, exceeded: bool
) -> None:
    verdict = deadline_exceeded(
        job_spec(activeDeadlineSeconds=deadline), started, T0 + dt.timedelta(seconds=elapsed_s)
    )
    assert (verdict is not None) == exceeded
    assert verdict is None or (verdict.reason, verdict.message) == (
        "DeadlineExceeded",
        "running longer than activeDeadlineSeconds=60",
    )


@pytest.mark.parametrize(
    ("progress", "succeeded"),
    [(None, False), (ProgressReport(step=3), False), (ProgressReport(step=4, done=True), True)],
    ids=["no-report", "running", "done"],
)
def test_job_success_table(progress: ProgressReport | None, succeeded: bool) -> None:
    verdict = job_success(job_spec(), seen(progress=progress))
    assert (verdict is not None) == succeeded
    assert verdict is None or (verdict.phase, verdict.reason) == (Phase.SUCCEEDED, "Completed")


PASSED = WeightChannelStatus(preflight_passed=True)
PHASES: list[tuple[str, dict[str, object], JobObserved, Phase | None, tuple[Phase, str]]] = [
    ("terminal is sticky", {}, seen(driver="Failed"), Phase.SUCCEEDED, (Phase.SUCCEEDED, "Terminal")),
    (
        "failure first",
        {},
        seen(driver="Failed", progress=ProgressReport(done=True)),
        None,
        (Phase.FAILED, "DriverFailed"),
    ),
    ("success", {}, seen(progress=ProgressReport(done=True)), Phase.RUNNING, (Phase.SUCCEEDED, "Completed")),
    ("suspended", {"suspend": True}, seen(), Phase.RUNNING, (Phase.SUSPENDED, "Suspended")),
    ("children missing", {}, seen(ranks=None), None, (Phase.PENDING, "CreatingChildren")),
    ("pods not ready", {}, seen(engines=0), Phase.PENDING, (Phase.PROVISIONING, "WaitingForPods")),
    ("running stays running", {}, seen(engines=0), Phase.RUNNING, (Phase.RUNNING, "Running")),
    ("check pending", {}, seen(), Phase.PROVISIONING, (Phase.PREFLIGHT, "PreflightRunning")),
    ("check passed", {}, seen(channel=PASSED), Phase.PREFLIGHT, (Phase.RUNNING, "PreflightPassed")),
    (
        "no check, init pending",
        {"weightSync": {"checkWeightUpdateEqual": False}},
        seen(),
        None,
        (Phase.PREFLIGHT, "Initializing"),
    ),
    (
        "no check, init done",
        {"weightSync": {"checkWeightUpdateEqual": False}},
        seen(progress=ProgressReport(step=0)),
        None,
        (Phase.RUNNING, "Initialized"),
    ),
]


@pytest.mark.parametrize(
    ("spec", "obs", "previous", "want"), [c[1:] for c in PHASES], ids=[c[0] for c in PHASES]
)
def test_job_phase_table(
    spec: dict[str, object], obs: JobObserved, previous: Phase | None, want: tuple[Phase, str]
) -> None:
    verdict = job_phase(job_spec(**spec), obs, previous)
    assert (verdict.phase, verdict.reason) == want


@pytest.mark.parametrize(
    ("statuses", "want"),
    [
        ([], None),
        ([{"name": "pull-model", "state": {"running": {}}}], None),
        ([{"name": "pull-model", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}], None),
        (
            [{"name": "pull-model", "state": {"terminated": {"exitCode": 2, "message": "error: no repo\n"}}}],
            "pull-model exited 2: error: no repo",
        ),
        (
            [
                {
                    "name": "pull-model",
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 2, "reason": "Error"}},
                }
            ],
            "pull-model exited 2: Error",
        ),
    ],
    ids=["none", "running", "done", "failed", "restarting"],
)
def test_init_failure_of_a_pod(statuses: list[dict[str, Any]], want: str | None) -> None:
    assert init_failure({"status": {"initContainerStatuses": statuses}}) == want
    assert init_failure(None) is None
