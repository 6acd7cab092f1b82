"""Golden tests of the advantage estimators (lockstep.train.common.advantages)."""

from __future__ import annotations

import math

import pytest
from lockstep.train.common.advantages import batch_advantages, group_advantages


def test_grpo_normalises_within_the_group() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], "grpo")
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)


def test_grpo_golden_uneven() -> None:
    # mean 0.25, population std sqrt(0.1875) = 0.4330
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], "grpo")
    assert adv[0] == pytest.approx(0.75 / math.sqrt(0.1875), rel=1e-5)
    assert adv[1] == pytest.approx(-0.25 / math.sqrt(0.1875), rel=1e-5)


def test_equal_rewards_give_zero_advantage() -> None:
    assert group_advantages([0.5, 0.5, 0.5], "grpo") == [0.0, 0.0, 0.0]
    assert group_advantages([1.0, 1.0], "gspo") == [0.0, 0.0]


def test_ppo_is_group_mean_baseline_without_std() -> None:
    assert group_advantages([1.0, 0.0, 0.5, 0.5], "ppo") == pytest.approx([0.5, -0.5, 0.0, 0.0])


def test_gspo_shares_grpo_advantages() -> None:
    assert group_advantages([0.2, 0.9, 0.4], "gspo") == group_advantages([0.2, 0.9, 0.4], "grpo")


def test_batch_never_mixes_groups() -> None:
    out = batch_advantages([[1.0, 0.0], [5.0, 5.0]])
    assert out[0] == pytest.approx([1.0, -1.0], abs=1e-5)
    assert out[1] == [0.0, 0.0]


def test_unknown_estimator_and_empty_group_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown advantage estimator 'reinforce'"):
        group_advantages([1.0], "reinforce")
    with pytest.raises(ValueError, match="at least one sample"):
        group_advantages([], "grpo")
