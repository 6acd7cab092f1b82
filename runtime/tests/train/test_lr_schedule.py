"""Table tests of the RL learning-rate schedule (lockstep.train.common.lr_schedule, a pure function)."""

from __future__ import annotations

import itertools
import math

import pytest
from lockstep.train.common.lr_schedule import LRSchedule, learning_rate_at, sft_done

LR = 1e-3


@pytest.mark.parametrize(
    ("schedule", "step", "want"),
    [
        # constant: the default, every step at the peak rate
        (LRSchedule(LR, 10), 1, LR),
        (LRSchedule(LR, 10), 10, LR),
        (LRSchedule(LR, 10), 11, LR),  # a longer resumed run keeps the rate
        # warmup: step k of n at lr * k / n, then the peak
        (LRSchedule(LR, 10, warmup_steps=4), 1, LR / 4),
        (LRSchedule(LR, 10, warmup_steps=4), 4, LR),
        (LRSchedule(LR, 10, warmup_steps=4), 5, LR),
        # linear decay over 10 steps to 1e-4: step 1 at the peak, each step 0.1 of the span lower
        (LRSchedule(LR, 10, decay="linear", min_learning_rate=1e-4), 1, LR),
        (LRSchedule(LR, 10, decay="linear", min_learning_rate=1e-4), 6, 1e-4 + 9e-4 * 0.5),
        (LRSchedule(LR, 10, decay="linear", min_learning_rate=1e-4), 10, 1e-4 + 9e-4 * 0.1),
        (LRSchedule(LR, 10, decay="linear", min_learning_rate=1e-4), 50, 1e-4 + 9e-4 * 0.1),
        # cosine after a warmup of 2: decay spans steps 3..10 (8 steps)
        (LRSchedule(LR, 10, warmup_steps=2, decay="cosine"), 3, LR),
        (LRSchedule(LR, 10, warmup_steps=2, decay="cosine"), 7, LR * 0.5 * (1 + math.cos(math.pi * 4 / 8))),
        (LRSchedule(LR, 10, warmup_steps=2, decay="cosine"), 10, LR * 0.5 * (1 + math.cos(math.pi * 7 / 8))),
    ],
)
def test_learning_rate_at(schedule: LRSchedule, step: int, want: float) -> None:
    assert learning_rate_at(schedule, step) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("decay", ["constant", "linear", "cosine"])
def test_every_step_trains_at_a_positive_rate_that_never_rises_after_warmup(decay: str) -> None:
    s = LRSchedule(LR, 500, warmup_steps=20, decay=decay)  # type: ignore[arg-type]
    rates = [learning_rate_at(s, k) for k in range(1, 501)]
    assert all(r > 0 for r in rates)
    assert rates[19] == LR
    assert all(a >= b for a, b in itertools.pairwise(rates[19:]))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"learning_rate": 0.0}, "learning_rate must be > 0"),
        ({"total_steps": 0}, "total_steps must be >= 1"),
        ({"warmup_steps": 10}, "warmup_steps must be in"),
        ({"warmup_steps": -1}, "warmup_steps must be in"),
        ({"decay": "step"}, "unknown decay 'step'"),
        ({"min_learning_rate": 2e-3}, "min_learning_rate must be in"),
    ],
)
def test_bad_schedule_is_refused(kwargs: dict[str, object], error: str) -> None:
    args: dict[str, object] = {"learning_rate": LR, "total_steps": 10} | kwargs
    with pytest.raises(ValueError, match=error):
        LRSchedule(**args)  # type: ignore[arg-type]


def test_steps_count_from_one() -> None:
    with pytest.raises(ValueError, match="RL steps count from 1"):
        learning_rate_at(LRSchedule(LR, 10), 0)


@pytest.mark.parametrize(
    ("losses", "target", "want"),
    [
        ([0.5] * 5, None, False),  # no target: run every step
        ([0.5] * 4, 0.6, False),  # fewer steps than the window
        ([0.5] * 5, 0.6, True),
        ([0.6] * 5, 0.6, True),  # at the target
        ([2.0, 0.4, 0.4, 0.4, 0.4, 0.4], 0.45, True),  # only the last 5 count
        ([0.3, 0.3, 0.3, 0.3, 1.0], 0.4, False),  # low steps and one high: the mean 0.44 decides
        ([0.3, 0.3, 0.3, 0.3, 1.0], 0.45, True),
    ],
)
def test_sft_done(losses: list[float], target: float | None, want: bool) -> None:
    assert sft_done(losses, target) is want
