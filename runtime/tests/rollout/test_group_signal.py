"""Table tests of the group-signal metrics and dynamic sampling's policy (lockstep.rollout.group_signal)."""

from __future__ import annotations

import pytest
from lockstep.rollout.group_signal import (
    group_signal_metrics,
    groups_to_generate,
    has_signal,
    keep_groups,
    select_groups,
)
from lockstep.types import Group, Sample


def group(index: int, rewards: list[float]) -> Group:
    return Group(
        index, [Sample(index, i, [1], [2], [1], [-0.5], [0], reward=r) for i, r in enumerate(rewards)]
    )


@pytest.mark.parametrize(
    ("rewards", "want"),
    [
        ([0.0, 1.0, 0.0], True),
        ([0.0, 0.0, 0.0], False),  # all wrong
        ([1.0, 1.0], False),  # all right
        ([0.3, 0.3 + 1e-12], False),  # float noise is no spread
        ([0.5, 0.7], True),  # partial credit
        ([1.0], False),  # a group of one never has a spread
        ([], False),
    ],
)
def test_has_signal(rewards: list[float], want: bool) -> None:
    assert has_signal(rewards) is want


@pytest.mark.parametrize(
    ("rows", "zero_var", "solved", "unsolved"),
    [
        ([[0, 1], [0, 0], [1, 1], [1, 0]], 0.5, 0.25, 0.25),
        ([[0, 0], [0, 0]], 1.0, 0.0, 1.0),
        ([[1, 1, 1]], 1.0, 1.0, 0.0),
        ([[0.5, 0.5]], 1.0, 0.0, 0.0),  # equal partial rewards: no spread, neither solved nor unsolved
        ([], 0.0, 0.0, 0.0),
    ],
)
def test_group_signal_metrics(
    rows: list[list[float]], zero_var: float, solved: float, unsolved: float
) -> None:
    assert group_signal_metrics(rows) == {
        "zero_variance_groups_frac": zero_var,
        "solved_groups_frac": solved,
        "unsolved_groups_frac": unsolved,
    }


@pytest.mark.parametrize(
    ("kept", "generated", "batch", "cap", "want"),
    [
        (8, 8, 8, 32, 0),  # the batch is full of groups with a spread: stop
        (5, 8, 8, 32, 3),  # three were dropped: generate three more
        (0, 8, 8, 32, 8),  # all dropped: a whole batch again
        (5, 30, 8, 32, 2),  # the cap allows only two more
        (5, 32, 8, 32, 0),  # the cap is reached: train on what there is
        (1, 8, 8, 8, 0),  # cap == batch: one round, never more
        (9, 12, 8, 32, 0),  # more than enough kept
    ],
)
def test_groups_to_generate(kept: int, generated: int, batch: int, cap: int, want: int) -> None:
    assert groups_to_generate(kept, generated, batch, cap) == want


@pytest.mark.parametrize(
    ("rewards", "batch", "want"),
    [
        ([[0, 0], [0, 1], [1, 1], [1, 0], [0, 1]], 2, [1, 3]),  # the first two with a spread, in order
        ([[0, 0], [0, 1], [1, 1]], 2, [1]),  # fewer than a batch: what there is
        ([[0, 0], [1, 1], [0, 0]], 2, [0, 1]),  # none: the first batch generated
    ],
)
def test_select_groups(rewards: list[list[float]], batch: int, want: list[int]) -> None:
    groups = [group(i, rs) for i, rs in enumerate(rewards)]
    assert [g.index for g in select_groups(groups, batch)] == want
    assert [g.index for g in keep_groups(groups)] == [i for i, rs in enumerate(rewards) if has_signal(rs)]
