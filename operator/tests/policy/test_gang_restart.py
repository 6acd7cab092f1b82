"""Table test of the gang restart policy (policy/gang_restart.py)."""

from __future__ import annotations

import pytest
from lockstep_operator.policy.gang_restart import GangDecision, RankPod, gang_restart


def rank(
    i: int,
    gen: int = 0,
    *,
    stale: bool = False,
    term: bool = False,
    failed: bool = False,
    succeeded: bool = False,
) -> RankPod:
    why = ""
    if failed:
        why = f"rank {i} (pod t-{i}) failed: Error (exit 1)"
    elif succeeded:
        why = f"rank {i} (pod t-{i}) exited 0 before the job completed"
    return RankPod(f"t-{i}", i, gen, not stale, term, failed, succeeded, why)


ALL = ("t-0", "t-1")
EXITED = "rank 1 (pod t-1) exited 0 before the job completed"
CASES: list[tuple[str, list[RankPod], dict[str, object], GangDecision]] = [
    ("healthy", [rank(0), rank(1)], {}, GangDecision(0, None, False, False, ALL, (), True)),
    ("none-yet: start every rank", [], {}, GangDecision(0, None, False, False, (), (), True)),
    (
        "one failed: counted restart, old generation deleted",
        [rank(0), rank(1, failed=True)],
        {},
        GangDecision(1, None, False, False, (), ALL, False, ("rank 1 (pod t-1) failed: Error (exit 1)",)),
    ),
    (
        "old generation still terminating: wait",
        [rank(0, term=True), rank(1, term=True)],
        {"restarts": 1},
        GangDecision(1, None, False, False, (), (), False),
    ),
    (
        "old generation gone: start the new one",
        [],
        {"restarts": 1},
        GangDecision(1, None, False, False, (), (), True),
    ),
    (
        "limit reached: failed, every pod deleted",
        [rank(0, 2), rank(1, 2, failed=True)],
        {"restarts": 2, "limit": 2},
        GangDecision(
            2,
            "rank 1 (pod t-1) failed: Error (exit 1); gang restart limit 2 reached",
            True,
            False,
            (),
            ALL,
            False,
            ("rank 1 (pod t-1) failed: Error (exit 1)",),
        ),
    ),
    (
        "failed before: stays failed, nothing starts",
        [],
        {"failed": "earlier"},
        GangDecision(0, "earlier", True, False, (), (), False),
    ),
    (
        "suspended: pods deleted, nothing counted",
        [rank(0), rank(1, failed=True)],
        {"stopped": True},
        GangDecision(0, None, True, False, (), ALL, False),
    ),
    (
        "spec changed: uncounted roll of the whole gang",
        [rank(0, stale=True), rank(1)],
        {},
        GangDecision(0, None, False, True, (), ALL, False),
    ),
    (
        "roll in flight: stale pods terminating, current kept",
        [rank(0, stale=True, term=True), rank(1)],
        {},
        GangDecision(0, None, False, True, ("t-1",), (), False),
    ),
    (
        "a failure during a roll is counted",
        [rank(0, stale=True), rank(1, failed=True)],
        {},
        GangDecision(1, None, False, True, (), ALL, False, ("rank 1 (pod t-1) failed: Error (exit 1)",)),
    ),
    # A rank exits 0 only after the driver's shutdown, which follows `done`: before, its group broke.
    (
        "succeeded rank mid-run (its peer's pod deleted): counted restart",
        [rank(0), rank(1, succeeded=True)],
        {},
        GangDecision(1, None, False, False, (), ALL, False, (EXITED,)),
    ),
    (
        "succeeded rank mid-run at the limit: failed with what happened",
        [rank(0, 2), rank(1, 2, succeeded=True)],
        {"restarts": 2, "limit": 2},
        GangDecision(2, f"{EXITED}; gang restart limit 2 reached", True, False, (), ALL, False, (EXITED,)),
    ),
    (
        "missing rank pod mid-run (deleted): counted restart, the survivor deleted too",
        [rank(1)],
        {},
        GangDecision(1, None, False, False, (), ("t-1",), False, ("rank 0's pod was deleted",)),
    ),
    (
        "missing rank pod, the survivor exited 0: both named, the cause first",
        [rank(1, succeeded=True)],
        {},
        GangDecision(1, None, False, False, (), ("t-1",), False, ("rank 0's pod was deleted", EXITED)),
    ),
    (
        "deleted rank pod still terminating (it checkpoints with its peer): wait",
        [rank(0, term=True), rank(1)],
        {},
        GangDecision(0, None, False, False, ("t-1",), (), False),
    ),
    (
        "missing rank before the generation was complete (a create failed): start it, no restart",
        [rank(1)],
        {"complete": False},
        GangDecision(0, None, False, False, ("t-1",), (), True),
    ),
    (
        "every rank deleted at once, one still terminating: no fault, the new world starts after",
        [rank(1, term=True)],
        {},
        GangDecision(0, None, False, False, (), (), False),
    ),
    (
        "all ranks succeeded after the driver reported done: no restart",
        [rank(0, succeeded=True), rank(1, succeeded=True)],
        {"done": True},
        GangDecision(0, None, False, False, ALL, (), True),
    ),
    (
        "a rank failed or vanished after done: no restart either (the job succeeds)",
        [rank(1, failed=True)],
        {"done": True},
        GangDecision(0, None, False, False, ("t-1",), (), True),
    ),
    (
        "succeeded rank while the job is Succeeded (stopped): no restart, pods deleted",
        [rank(0, succeeded=True), rank(1, succeeded=True)],
        {"stopped": True},
        GangDecision(0, None, True, False, (), ALL, False),
    ),
]


@pytest.mark.parametrize(("pods", "args", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_gang_restart_table(pods: list[RankPod], args: dict[str, object], want: GangDecision) -> None:
    kwargs: dict[str, object] = {
        "ranks": 2,
        "restarts": 0,
        "limit": 3,
        "stopped": False,
        "failed": None,
        "done": False,
        "complete": True,
        **args,
    }
    assert gang_restart(pods, **kwargs) == want  # type: ignore[arg-type]
