"""How fast and how long the policy trains: the RL learning rate of each step, the SFT warm start's end.

Why it exists: a constant rate that is fast enough for the rise keeps shaking a nearly solved policy
at the end of a run (how far a run got at its last steps depended on the data seed); a decay lets
it settle, a warmup lets Adam's moments form on RL gradients before full-size steps. The schedule is
spec.algorithm.lrSchedule over spec.schedule.steps; one pure function, table-tested, used by every
backend through the trainer.

The SFT warm start ends at a loss target when one is set (`sft_done`): after a fixed step count the
seeds of bench/seed_sweep.py were anywhere between loss 0.50 and 1.02 on a steep curve.

Who calls it: lockstep.trainer.local (before every RL optimizer step, after every SFT step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Decay = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True, slots=True)
class LRSchedule:
    """spec.algorithm.lrSchedule with the rates and the run length it applies to."""

    learning_rate: float
    """Peak rate: after warmup, and throughout with decay `constant`."""
    total_steps: int
    """RL steps of the run (spec.schedule.steps): the decay spans them."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 (fewer than total_steps)."""
    decay: Decay = "constant"
    """Shape after warmup."""
    min_learning_rate: float = 0.0
    """Where a decay ends, one step after the last (at most learning_rate)."""

    def __post_init__(self) -> None:
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(
                f"warmup_steps must be in [0, total_steps={self.total_steps}), got {self.warmup_steps}"
            )
        if self.decay not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown decay {self.decay!r}; use constant, linear or cosine")
        if not 0 <= self.min_learning_rate <= self.learning_rate:
            raise ValueError(
                f"min_learning_rate must be in [0, learning_rate={self.learning_rate}], got {self.min_learning_rate}"
            )


def learning_rate_at(schedule: LRSchedule, step: int) -> float:
    """The rate of RL step `step` (1-based: the first optimizer step of RL is step 1). Pure.

    Warmup: step k <= warmup trains at lr * k / warmup. Decay: the first step after warmup trains at
    lr, and the rate falls towards min_learning_rate, which it would reach one step after the last
    (so every step trains at a rate > 0, min_learning_rate 0 included); steps past total_steps (a
    longer resumed run) keep the last step's rate.
    """
    if step < 1:
        raise ValueError(f"RL steps count from 1, got {step}")
    s = schedule
    if step <= s.warmup_steps:
        return s.learning_rate * step / s.warmup_steps
    if s.decay == "constant":
        return s.learning_rate
    span = s.total_steps - s.warmup_steps
    progress = (min(step - s.warmup_steps, span) - 1) / span  # [0, 1): 0 right after warmup
    shape = 1.0 - progress if s.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return s.min_learning_rate + (s.learning_rate - s.min_learning_rate) * shape


SFT_STOP_WINDOW = 5
"""SFT steps averaged by `sft_done`: one step's loss (one batch) is too noisy to stop on."""


def sft_done(losses: Sequence[float], stop_at_loss: float | None, window: int = SFT_STOP_WINDOW) -> bool:
    """True when the SFT warm start may end before its step cap: the mean loss of its last `window`
    steps is at or below `stop_at_loss` (never with fewer steps, never without a target). Pure."""
    if stop_at_loss is None or len(losses) < window:
        return False
    return sum(losses[-window:]) / window <= stop_at_loss
