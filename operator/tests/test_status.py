"""Golden tests of the pure status functions: job phases, pool readiness by version, trainer, channel."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml
from lockstep.api.common import ConditionStatus
from lockstep.api.progress import progress_patch, rank_key
from lockstep.api.rljob import Phase, RLJob, RLJobSpec, RLJobStatus
from lockstep.api.rolloutpool import RolloutPoolStatus
from lockstep.api.trainergroup import TrainerGroupStatus
from lockstep.api.weightchannel import WeightChannelStatus
from lockstep_operator.reconcile.progress import ProgressReport, read_progress, read_rank_reports
from lockstep_operator.reconcile.status import (
    JobObserved,
    channel_status,
    condition,
    job_status,
    pool_status,
    set_condition,
    shared_weights_current,
    trainer_status,
    weights_current,
)
from lockstep_operator.topology import Decision

T0 = dt.datetime(2026, 12, 2, 10, 0, tzinfo=dt.UTC)
T1 = T0 + dt.timedelta(minutes=1)


def spec(check: bool = True, **rollout: Any) -> RLJobSpec:
    raw = yaml.safe_load((Path(__file__).parent / "fixtures" / "tiny-local.yaml").read_text())
    raw["spec"]["weightSync"]["checkWeightUpdateEqual"] = check
    raw["spec"]["rollout"].update(rollout)
    return RLJob.model_validate(raw).spec


def observed(
    *,
    ready: bool = True,
    driver: str | None = "Running",
    progress: ProgressReport | None = None,
    channel: WeightChannelStatus | None = None,
    trainer_failed: str | None = None,
    gang: str | None = None,
    rank_reports: dict[int, ProgressReport] | None = None,
) -> JobObserved:
    trainer = trainer_status(
        [pod("t-0", ready)],
        nodes=1,
        gpus_per_node=1,
        restarts=0,
        failed=trainer_failed,
        previous=None,
        step=None,
        generation=1,
        now=T0,
    )
    pool = RolloutPoolStatus(replicas=1, ready_replicas=1 if ready else 0)
    return JobObserved(
        pool=pool,
        trainer=trainer,
        channel=channel,
        progress=progress,
        progress_problem=None,
        driver_phase=driver,
        gang_problem=gang,
        rank_reports=rank_reports or {},
    )


def pod(name: str, ready: bool, replica: int = 0, ip: str | None = "10.0.0.1") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"rl.lockstep.dev/replica": str(replica)}},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }  # fmt: skip


def phase(s: RLJobSpec, obs: JobObserved, prev: Phase | None = None) -> RLJobStatus:
    return job_status(s, obs, RLJobStatus(phase=prev) if prev else None, generation=1, now=T1)


def test_phases_in_order() -> None:
    s = spec()
    empty = JobObserved(None, None, None, None, None, None, None)
    assert phase(s, empty).phase == Phase.PENDING
    assert phase(s, observed(ready=False)).phase == Phase.PROVISIONING
    assert phase(s, observed()).phase == Phase.PREFLIGHT
    passed = WeightChannelStatus(preflight_passed=True)
    st = phase(s, observed(channel=passed))
    assert st.phase == Phase.RUNNING and st.start_time == T1
    assert condition(st.conditions, "Progressing").status == ConditionStatus.TRUE  # type: ignore[union-attr]


def test_without_the_check_running_waits_for_the_init_step() -> None:
    s = spec(check=False)
    assert phase(s, observed()).phase == Phase.PREFLIGHT
    assert phase(s, observed(progress=ProgressReport(step=0))).phase == Phase.RUNNING
    pf = condition(phase(s, observed()).conditions, "PreflightPassed")
    assert pf is not None and pf.status == ConditionStatus.UNKNOWN and pf.reason == "NotRequested"


def test_preflight_failure_names_tensors_and_is_sticky() -> None:
    s = spec()
    bad = ProgressReport(step=0, preflight="failed", preflight_mismatched=["lm_head.weight"])
    st = phase(s, observed(progress=bad))
    failed = condition(st.conditions, "Failed")
    assert st.phase == Phase.FAILED and failed is not None and "lm_head.weight" in failed.message
    assert st.completion_time == T1
    assert (
        phase(s, observed(channel=WeightChannelStatus(preflight_passed=True)), Phase.FAILED).phase
        == Phase.FAILED
    )


def test_trainer_limit_and_driver_errors_fail_the_job() -> None:
    s = spec()
    st = phase(s, observed(trainer_failed="rank 1 failed: OOMKilled"))
    assert st.phase == Phase.FAILED and "OOMKilled" in condition(st.conditions, "Failed").message  # type: ignore[union-attr]
    assert phase(s, observed(progress=ProgressReport(error="dataset missing"))).phase == Phase.FAILED


@pytest.mark.parametrize("running_before", [False, True])
def test_a_start_failure_fails_the_job_with_its_reason_in_one_pass(running_before: bool) -> None:
    # What the driver and a rank write when they cannot start (their own patch bodies), as the
    # reconcile reads them back: the job is Failed in the same pass, from any phase before.
    s = spec()
    prev = Phase.RUNNING if running_before else Phase.PROVISIONING
    driver_doc = progress_patch(
        ProgressReport(
            error="driver could not start: FileNotFoundError: /models/nope", reason="DriverStartFailed"
        )
    )
    report, problem = read_progress(driver_doc)
    st = phase(s, observed(ready=False, progress=report), prev)
    failed = condition(st.conditions, "Failed")
    assert problem is None and st.phase == Phase.FAILED and st.completion_time == T1
    assert failed is not None and failed.status == ConditionStatus.TRUE
    assert (failed.reason, failed.message) == (
        "DriverStartFailed",
        "driver could not start: FileNotFoundError: /models/nope",
    )

    rank_doc = progress_patch(
        ProgressReport(
            error="trainer rank 2 could not start: no tokenizer.json", reason="TrainerStartFailed"
        ),
        rank_key(2),
    )
    st = phase(s, observed(ready=False, rank_reports=read_rank_reports(rank_doc)), prev)
    failed = condition(st.conditions, "Failed")
    assert st.phase == Phase.FAILED and failed is not None
    assert (failed.reason, failed.message) == (
        "TrainerStartFailed",
        "trainer rank 2 could not start: no tokenizer.json",
    )


def test_read_rank_reports_keeps_only_rank_documents() -> None:
    data = {
        "progress.json": '{"step": 1}',
        "rank-0.json": '{"error": "e0", "reason": "TrainerStartFailed"}',
        "rank-1.json": "not json",
        "rank-x.json": '{"error": "e"}',
        "rank-2.json": '{"errorr": "e"}',
    }
    assert read_rank_reports({"data": data}) == {0: ProgressReport(error="e0", reason="TrainerStartFailed")}
    assert read_rank_reports(None) == {} and read_rank_reports({}) == {}


def test_done_suspended_and_degraded() -> None:
    s = spec()
    assert phase(s, observed(progress=ProgressReport(step=20, done=True))).phase == Phase.SUCCEEDED
    assert phase(s.model_copy(update={"suspend": True}), observed()).phase == Phase.SUSPENDED
    st = phase(s, observed(ready=False), Phase.RUNNING)
    assert st.phase == Phase.RUNNING
    assert condition(st.conditions, "Degraded").status == ConditionStatus.TRUE  # type: ignore[union-attr]


def test_missing_scheduler_is_not_admitted() -> None:
    st = phase(spec(), observed(gang="volcano is not installed"))
    admitted = condition(st.conditions, "Admitted")
    assert admitted is not None and admitted.status == ConditionStatus.FALSE and "volcano" in admitted.message


def test_progress_is_folded_into_status() -> None:
    prog = ProgressReport(step=7, weight_version=7, reward=0.5, staleness=2, queue_size=3)
    obs = observed(progress=prog, channel=WeightChannelStatus(preflight_passed=True))
    st = phase(spec(), obs, Phase.RUNNING)
    assert (st.step, st.reward, st.staleness, st.queue_size) == (7, 0.5, 2, 3)


def test_condition_transition_time_moves_only_on_change() -> None:
    c1 = set_condition([], "Ready", True, "A", "", now=T0, generation=1)
    c2 = set_condition(c1, "Ready", True, "B", "x", now=T1, generation=2)
    c3 = set_condition(c2, "Ready", False, "C", "", now=T1, generation=2)
    assert c2[0].last_transition_time == T0 and c2[0].reason == "B" and c3[0].last_transition_time == T1


def test_pool_engine_ready_only_at_the_current_version() -> None:
    pods = [pod("p-0", True, 0), pod("p-1", True, 1), pod("p-2", False, 2, None)]
    st = pool_status(
        pods,
        selector="a=b",
        current_version=3,
        engine_versions={"p-0": 3, "p-1": 2},
        min_available=2,
        previous=None,
        generation=1,
        now=T0,
    )
    assert st.replicas == 3 and st.ready_replicas == 1 and st.weight_version == 3
    assert [e.ready for e in st.engines] == [True, False, False] and st.engines[2].address is None
    synced = condition(st.conditions, "WeightsSynced")
    assert synced is not None and synced.status == ConditionStatus.FALSE and "p-1" in synced.message
    breached = condition(st.conditions, "MinAvailableBreached")
    assert breached is not None and breached.status == ConditionStatus.TRUE
    before_any = pool_status(
        pods[:2],
        selector="a=b",
        current_version=None,
        engine_versions={},
        min_available=1,
        previous=None,
        generation=1,
        now=T0,
    )
    assert before_any.ready_replicas == 2  # no version published yet: health alone decides
    through_router = pool_status(
        pods[:2],
        selector="a=b",
        current_version=3,
        engine_versions={},
        min_available=1,
        previous=None,
        generation=1,
        now=T0,
    )
    assert through_router.ready_replicas == 2  # no per-engine versions reported: the push's guarantee stands


def test_trainer_status_counts_ranks() -> None:
    st = trainer_status(
        [pod("t-0", True), pod("t-1", False)],
        nodes=2,
        gpus_per_node=4,
        restarts=1,
        failed=None,
        previous=None,
        step=3,
        generation=1,
        now=T0,
    )
    assert (st.world_size, st.ready_ranks, st.restarts) == (8, 4, 1)
    assert condition(st.conditions, "Degraded").status == ConditionStatus.TRUE  # type: ignore[union-attr]
    assert TrainerGroupStatus.model_validate(st.wire()) == st


def test_channel_status_keeps_choice_while_waiting_and_reports_preflight() -> None:
    chosen = channel_status(
        Decision("p2p", "RDMA everywhere", ("p2p", "broadcast")),
        progress=None,
        previous=None,
        generation=1,
        now=T0,
    )
    assert chosen.transport is not None and chosen.transport.value == "p2p"
    waiting = channel_status(
        Decision(None, "waiting", ()),
        progress=ProgressReport(preflight="passed"),
        previous=chosen,
        generation=1,
        now=T1,
    )
    assert waiting.transport == chosen.transport and waiting.reason == "RDMA everywhere"
    assert waiting.preflight_passed is True
    rejected = channel_status(
        Decision("broadcast", "b", ("broadcast",), "p2p needs RDMA"),
        progress=None,
        previous=None,
        generation=1,
        now=T0,
    )
    feas = condition(rejected.conditions, "RequestedTransportFeasible")
    assert feas is not None and feas.status == ConditionStatus.FALSE and "RDMA" in feas.message
    # Pods unscheduled for a while (a gang restart): the kept choice keeps its verdict on the request,
    # not "Feasible" next to the fallback it did not choose.
    later = channel_status(
        Decision(None, "waiting", ()), progress=None, previous=rejected, generation=1, now=T1
    )
    assert later.transport == rejected.transport
    kept = condition(later.conditions, "RequestedTransportFeasible")
    assert kept is not None and kept.status == ConditionStatus.FALSE and "RDMA" in kept.message


def test_channel_status_shows_the_last_update_by_phase() -> None:
    phases = {"gather": 0.5, "transfer": 2.5, "engine_load": 1.0, "pause": 0.0}
    progress = ProgressReport(weight_version=3, last_update_seconds=4.0, last_update_phases=phases)
    st = channel_status(Decision("broadcast", "b", ("broadcast",)), progress=progress, previous=None,
                        generation=1, now=T0)  # fmt: skip
    assert st.last_update_seconds == 4.0 and st.last_update_phases == phases
    assert st.last_update_slowest == "transfer 62%"  # what `kubectl get wch` shows in its Slowest column
    wire = st.wire()
    assert wire["lastUpdatePhases"] == phases and wire["lastUpdateSlowest"] == "transfer 62%"
    # A document without an update (a driver restarted) keeps nothing stale beside a new choice.
    kept = channel_status(Decision("broadcast", "b", ("broadcast",)), progress=None, previous=st,
                          generation=1, now=T1)  # fmt: skip
    assert kept.last_update_phases == phases and kept.last_update_slowest == "transfer 62%"


def test_channel_is_degraded_while_a_fallback_delivers_the_updates() -> None:
    p2p = Decision("p2p", "RDMA everywhere", ("p2p", "broadcast"))
    fell = ProgressReport(weight_version=7, last_update_seconds=2.0, last_update_fallback="broadcast",
                          update_fallbacks=1)  # fmt: skip
    st = channel_status(p2p, progress=fell, previous=None, generation=1, now=T0)
    deg = condition(st.conditions, "Degraded")
    assert deg is not None and deg.status == ConditionStatus.TRUE and deg.reason == "TransportFellBack"
    assert "version 7 failed on p2p and broadcast delivered it" in deg.message
    assert st.last_update_fallback == "broadcast" and st.update_fallbacks == 1
    ok = ProgressReport(weight_version=8, last_update_seconds=1.0, update_fallbacks=1)
    st = channel_status(p2p, progress=ok, previous=st, generation=1, now=T1)
    deg = condition(st.conditions, "Degraded")
    assert deg is not None and deg.status == ConditionStatus.FALSE and st.update_fallbacks == 1


def test_read_progress_contract() -> None:
    assert read_progress(None) == (None, None)
    report, problem = read_progress(
        {"data": {"progress.json": '{"step": 1, "weightVersion": 1, "queueSize": 0}'}}
    )
    assert report is not None and report.weight_version == 1 and problem is None
    report, problem = read_progress({"data": {"progress.json": '{"stepp": 1}'}})
    assert report is None and problem is not None and "stepp" in problem


def test_active_deadline_fails_a_running_job() -> None:
    s = spec().model_copy(update={"active_deadline_seconds": 30})
    prev = RLJobStatus(phase=Phase.RUNNING, start_time=T0)
    st = job_status(
        s, observed(channel=WeightChannelStatus(preflight_passed=True)), prev, generation=1, now=T1
    )
    failed = condition(st.conditions, "Failed")
    assert st.phase == Phase.FAILED and failed is not None and failed.reason == "DeadlineExceeded"


def test_engine_versions_keyed_by_address_gate_the_engines() -> None:
    """The driver reports `<pod IP>:30000` -> version (it resolves the headless engines Service)."""
    pods = [pod("p-0", True, 0, "10.0.0.1"), pod("p-1", True, 1, "10.0.0.2"), pod("p-2", True, 2, "10.0.0.3")]
    addresses = {"10.0.0.1:30000": 5, "10.0.0.2:30000": 4}
    verdicts = [weights_current(p, 5, {}, addresses) for p in pods]
    assert [v[0] for v in verdicts] == [True, False, False]
    assert "holds 4" in verdicts[1][1] and "not reported" in verdicts[2][1]  # p-2: new or unreachable
    st = pool_status(pods, selector="a=b", current_version=5, engine_versions={}, min_available=1,
                     previous=None, generation=1, now=T0, address_versions=addresses)  # fmt: skip
    assert st.ready_replicas == 1 and [e.weight_version for e in st.engines] == [5, 4, None]
    # A name-keyed entry wins over the address (both are the driver's word for the same engine).
    assert weights_current(pods[1], 5, {"p-1": 5}, addresses)[0] is True
    assert weights_current(pods[0], None, {}, {})[0] is True  # nothing published yet


def _report(version: int | None, addresses: dict[str, int]) -> ProgressReport:
    return ProgressReport(step=1, weight_version=version, engine_address_versions=addresses)


OLD, NEW = pod("shared-0", True, 0, "10.0.0.1"), pod("shared-1", True, 1, "10.0.0.9")


@pytest.mark.parametrize(
    ("engine", "jobs", "want", "why"),
    [
        (NEW, [], True, "no running job samples on the pool"),
        (NEW, [("a", None)], True, "every running job on the pool (a)"),  # nothing reported yet
        (NEW, [("a", _report(None, {}))], True, "(a)"),  # nothing published yet
        (OLD, [("a", _report(5, {"10.0.0.1:30000": 5})), ("b", _report(2, {"10.0.0.1:30000": 2}))], True, "(a, b)"),
        # joined after a published its version 5: out of the router until a's trainer loads 6 there
        (NEW, [("a", _report(5, {"10.0.0.1:30000": 5}))], False, "RLJob a's adapter: not reported"),
        (NEW, [("a", _report(6, {"10.0.0.1:30000": 6, "10.0.0.9:30000": 6}))], True, "(a)"),
        # a's next version reached it, b's not yet: b still gates it
        (NEW, [("a", _report(6, {"10.0.0.9:30000": 6})), ("b", _report(2, {"10.0.0.1:30000": 2}))], False, "RLJob b's"),
        (OLD, [("a", _report(6, {"10.0.0.1:30000": 5}))], False, "holds 5; the current weight version is 6"),
        (NEW, [("a", _report(5, {}))], True, "(a)"),  # a driver that reports no per-engine versions
    ],
    ids=["no-job", "no-report", "nothing-published", "both-current", "joined-behind", "joined-caught-up",
         "one-job-behind", "behind", "no-per-engine-versions"],
)  # fmt: skip
def test_a_shared_pools_engine_is_current_when_it_holds_every_jobs_adapter(
    engine: dict[str, Any], jobs: list[tuple[str, ProgressReport | None]], want: bool, why: str
) -> None:
    current, message = shared_weights_current(engine, jobs)
    assert current is want and why in message, message
