"""Table test of the gang restart policy (policy/gang_restart.py)."""

from __future__ import annotations

import pytest
from lockstep_operator.policy.gang_restart import GangDecision, RankPod, gang_restart


def rank(i: int, gen: int = 0, *, stale: bool = False, term: bool = False, failed: bool = False) -> RankPod:
    return RankPod(
        f"t-{i}",
        gen,
        not stale,
        term,
        failed,
        f"rank {i} (pod t-{i}) failed: Error (exit 1)" if failed else "",
    )


ALL = ("t-0", "t-1")
CASES: list[tuple[str, list[RankPod], dict[str, object], GangDecision]] = [
    ("healthy", [rank(0), rank(1)], {}, GangDecision(0, None, False, False, ALL, (), True)),
    ("none-yet: start every rank", [], {}, GangDecision(0, None, False, False, (), (), True)),
    (
        "one failed: counted restart, old generation deleted",
        [rank(0), rank(1, failed=True)],
        {},
        GangDecision(1, None, False, False, (), ALL, False),
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
        GangDecision(1, None, False, True, (), ALL, False),
    ),
]


@pytest.mark.parametrize(("pods", "args", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_gang_restart_table(pods: list[RankPod], args: dict[str, object], want: GangDecision) -> None:
    kwargs: dict[str, object] = {"restarts": 0, "limit": 3, "stopped": False, "failed": None, **args}
    assert gang_restart(pods, **kwargs) == want  # type: ignore[arg-type]
