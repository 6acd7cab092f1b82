"""Table tests of the Events each transition tells, and of the ReconcileError condition's policy."""

from __future__ import annotations

import pytest
from lockstep.api.common import Condition
from lockstep.api.rljob import Phase, RLJobStatus, Transport
from lockstep.api.rolloutpool import EngineStatus, RolloutPoolStatus
from lockstep.api.weightchannel import WeightChannelStatus
from lockstep_operator.policy import events as ev
from lockstep_operator.policy import reconcile_error
from lockstep_operator.policy.events import Event, Reason, normal, warning
from policy_fixtures import T0, cond

ERR = cond("ReconcileError", True, "QuotaExceeded", 'pods "j-rollout-0" is forbidden: exceeded quota: q')


def job(phase: Phase | None, *conditions: Condition, **fields: object) -> RLJobStatus:
    return RLJobStatus(phase=phase, conditions=list(conditions), **fields)  # type: ignore[arg-type]


JOB: list[tuple[str, RLJobStatus | None, RLJobStatus, list[Event]]] = [
    ("created", None, job(Phase.PENDING), [normal(Reason.PENDING, "Pending")]),
    (
        "provisioning names what is missing",
        job(Phase.PENDING),
        job(Phase.PROVISIONING, cond("Progressing", False, "WaitingForPods", "engines ready 0/1")),
        [normal(Reason.PROVISIONING, "engines ready 0/1")],
    ),
    ("no change, no event", job(Phase.RUNNING), job(Phase.RUNNING), []),
    (
        "failed with its reason",
        job(Phase.RUNNING),
        job(Phase.FAILED, cond("Failed", True, "PreflightFailed", "tensors that differ: w")),
        [warning(Reason.FAILED, "PreflightFailed: tensors that differ: w")],
    ),
    (
        "succeeded at its step",
        job(Phase.RUNNING),
        job(Phase.SUCCEEDED, step=70),
        [normal(Reason.SUCCEEDED, "finished at step 70")],
    ),
    (
        "resumed",
        job(Phase.SUSPENDED),
        job(Phase.PROVISIONING),
        [normal(Reason.RESUMED, "spec.suspend is false: Provisioning")],
    ),
    (
        "degraded, then recovered",
        job(Phase.RUNNING, cond("Degraded", False)),
        job(Phase.RUNNING, cond("Degraded", True, "Degraded", "engines ready 0/1")),
        [warning(Reason.DEGRADED, "engines ready 0/1")],
    ),
    (
        "recovered",
        job(Phase.RUNNING, cond("Degraded", True)),
        job(Phase.RUNNING, cond("Degraded", False)),
        [normal(Reason.RECOVERED, "every pod of the job is ready again")],
    ),
    (
        "first Degraded=False is no recovery",
        job(Phase.PENDING),
        job(Phase.PENDING, cond("Degraded", False)),
        [],
    ),
    (
        "not admitted",
        job(Phase.PENDING),
        job(Phase.PENDING, cond("Admitted", False, "SchedulerNotInstalled", "install volcano")),
        [warning(Reason.NOT_ADMITTED, "install volcano")],
    ),
    (
        "transport chosen",
        job(Phase.PROVISIONING),
        job(Phase.PROVISIONING, transport=Transport.BROADCAST, transport_reason="one network"),
        [normal(Reason.TRANSPORT_CHOSEN, "broadcast: one network")],
    ),
    (
        "pre-flight failed",
        job(Phase.PREFLIGHT),
        job(Phase.PREFLIGHT, cond("PreflightPassed", False, "Mismatch", "tensors that differ: w")),
        [warning(Reason.PREFLIGHT_FAILED, "tensors that differ: w")],
    ),
    (
        "a reconcile error cleared",
        job(Phase.PENDING, ERR),
        job(Phase.PENDING),
        [normal(Reason.RECONCILED, f"reconciled again after: {ERR.message}")],
    ),
    (
        "a reconcile error appearing is posted by the failed pass, not here",
        job(Phase.PENDING),
        job(Phase.PENDING, ERR),
        [],
    ),
]


@pytest.mark.parametrize(("before", "after", "want"), [c[1:] for c in JOB], ids=[c[0] for c in JOB])
def test_job_events(before: RLJobStatus | None, after: RLJobStatus, want: list[Event]) -> None:
    assert ev.job_events(before, after) == want


def pool(engines: int, generation: int, *conditions: Condition) -> RolloutPoolStatus:
    listed = [EngineStatus(name=f"e-{i}", ready=True) for i in range(engines)]
    return RolloutPoolStatus(
        replicas=engines, engines=listed, observed_generation=generation, conditions=list(conditions)
    )


POOL: list[tuple[str, RolloutPoolStatus | None, RolloutPoolStatus, int, int, list[Event]]] = [
    ("scaled up", pool(1, 1), pool(1, 2), 2, 2, [normal(Reason.SCALED, "replicas 1 -> 2")]),
    ("scaled down", pool(2, 2), pool(1, 3), 3, 1, [normal(Reason.SCALED, "replicas 2 -> 1")]),
    ("an image roll is no scale", pool(2, 2), pool(2, 3), 3, 2, []),
    ("a replaced engine is no scale (generation unchanged)", pool(0, 2), pool(1, 2), 2, 1, []),
    ("first status", None, pool(1, 1), 1, 1, []),
    (
        "lagging engine",
        pool(2, 1, cond("WeightsSynced", True)),
        pool(2, 1, cond("WeightsSynced", False, "Versions", "engines behind version 3: e-1")),
        1,
        2,
        [warning(Reason.WEIGHT_SYNC_LAGGING, "engines behind version 3: e-1")],
    ),
    (
        "caught up",
        pool(2, 1, cond("WeightsSynced", False)),
        pool(2, 1, cond("WeightsSynced", True)),
        1,
        2,
        [normal(Reason.WEIGHTS_SYNCED, "every engine holds weight version None")],
    ),
]


@pytest.mark.parametrize(
    ("before", "after", "generation", "replicas", "want"), [c[1:] for c in POOL], ids=[c[0] for c in POOL]
)
def test_pool_events(
    before: RolloutPoolStatus | None,
    after: RolloutPoolStatus,
    generation: int,
    replicas: int,
    want: list[Event],
) -> None:
    assert ev.pool_events(before, after, generation=generation, replicas=replicas) == want


def test_channel_events_tell_the_choice_an_infeasible_request_and_the_preflight() -> None:
    before = WeightChannelStatus()
    after = WeightChannelStatus(
        transport=Transport.BROADCAST,
        reason="one network",
        conditions=[
            cond("RequestedTransportFeasible", False, "Infeasible", "p2p: no RDMA"),
            cond("PreflightPassed", True, "Equal"),
        ],
    )
    assert ev.channel_events(before, after) == [
        normal(Reason.TRANSPORT_CHOSEN, "broadcast: one network"),
        warning(Reason.TRANSPORT_INFEASIBLE, "p2p: no RDMA"),
        normal(Reason.PREFLIGHT_PASSED, "weights equal in every engine after the initial sync"),
    ]
    assert ev.channel_events(after, after) == []


TRAINER = [
    (
        "a counted restart names the rank",
        dict(
            restarts_before=0,
            restarts=1,
            failed_before=False,
            failed=None,
            broken=["rank 1 (pod t-1) failed: Error (exit 137)"],
        ),
        [
            warning(
                Reason.GANG_RESTART,
                "rank 1 (pod t-1) failed: Error (exit 137): restarting every rank (restart 1 of 3)",
            )
        ],
    ),
    (
        "the limit reached",
        dict(
            restarts_before=3,
            restarts=3,
            failed_before=False,
            failed="rank 0 failed; gang restart limit 3 reached",
            broken=["rank 0 failed"],
        ),
        [warning(Reason.GANG_RESTART_LIMIT, "rank 0 failed; gang restart limit 3 reached")],
    ),
    (
        "the limit reached once only",
        dict(restarts_before=3, restarts=3, failed_before=True, failed="rank 0 failed; limit", broken=[]),
        [],
    ),
]


@pytest.mark.parametrize(("kw", "want"), [c[1:] for c in TRAINER], ids=[c[0] for c in TRAINER])
def test_trainer_events(kw: dict[str, object], want: list[Event]) -> None:
    assert ev.trainer_events([], [], limit=3, **kw) == want  # type: ignore[arg-type]


def test_trainer_roll_events() -> None:
    rolling = [cond("UpToDate", False, "SpecChanged", "spec changed: restarting every rank")]
    done = [cond("UpToDate", True, "SpecChanged", "every rank restarted for a spec change")]
    kw = dict(restarts_before=0, restarts=0, limit=3, failed_before=False, failed=None, broken=[])
    assert ev.trainer_events([cond("UpToDate", True, "Current")], rolling, **kw) == [  # type: ignore[arg-type]
        normal(Reason.GANG_ROLL, "spec changed: restarting every rank")
    ]
    assert ev.trainer_events(rolling, done, **kw) == [
        normal(Reason.GANG_ROLLED, "every rank restarted for a spec change")
    ]  # type: ignore[arg-type]


CLASSIFY = [
    (403, 'pods "x" is forbidden: exceeded quota: q, requested: pods=1', "QuotaExceeded"),
    (
        403,
        'pods "x" is forbidden: violates PodSecurity "restricted:latest": seccompProfile',
        "AdmissionDenied",
    ),
    (422, "ValidatingAdmissionPolicy 'lockstep-images' denied request: image not allowed", "AdmissionDenied"),
    (403, 'pods is forbidden: User "system:serviceaccount:x:y" cannot create resource "pods"', "Forbidden"),
    (422, 'Pod "x" is invalid: spec.containers[0].image: Required value', "Invalid"),
    (503, "etcdserver: leader changed", "ApiUnavailable"),
    (None, "KeyError: 'spec'", "InternalError"),
]


@pytest.mark.parametrize(
    ("status", "message", "reason"), CLASSIFY, ids=[c[2] + str(i) for i, c in enumerate(CLASSIFY)]
)
def test_refusals_are_classified(status: int | None, message: str, reason: str) -> None:
    assert reconcile_error.classify(status, message) == reason


def test_the_job_shows_its_first_failing_childs_error_and_drops_it_after() -> None:
    mine = [cond("Admitted", True), cond("ReconcileError", True, "Forbidden", "old")]
    folded = reconcile_error.fold_children(
        mine, [("TrainerGroup", []), ("RolloutPool", [ERR])], now=T0, generation=2
    )
    error = next(c for c in folded if c.type == "ReconcileError")
    assert (error.reason, error.message) == ("QuotaExceeded", f"RolloutPool: {ERR.message}")
    assert [
        c.type for c in reconcile_error.fold_children(mine, [("RolloutPool", [])], now=T0, generation=2)
    ] == ["Admitted"]
