"""RunSettings: the driver's knobs of one run, read once from the RLJob (a pure function, golden-tested).

Why it exists: the loops should read plain, validated numbers, not walk the manifest. `settings_from_job`
is the one place that maps manifest fields to them. Settings nest instead of copying: `Schedule` is
what both loops count (the fully-async loop's AsyncSettings holds the same object), and the trainer's
knobs are the TrainerSettings the trainer side builds for itself (lockstep.trainer.settings).

Who calls it: lockstep.driver.components, lockstep.driver.fully_async.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lockstep.trainer.settings import TrainerSettings

if TYPE_CHECKING:
    from lockstep.api import RLJob


class Resume(enum.Enum):
    """Whether a run starts from the trainer's latest checkpoint."""

    NEVER = "never"
    """Start fresh (`lockstep run` without --resume)."""
    REQUIRED = "required"
    """Resume; no checkpoint is an error naming where none was found (`--resume`)."""
    IF_ANY = "if-any"
    """Resume when there is a checkpoint, else start fresh (a driver pod, whose restarts resume)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """What both loops count: steps, the batch, and when to update weights, save and evaluate."""

    steps: int
    """Optimizer steps to reach (a resumed run continues up to this)."""
    batch_groups: int
    """Groups per step (spec.algorithm.batchSize)."""
    samples_per_prompt: int
    """Samples per group (spec.algorithm.samplesPerPrompt)."""
    update_interval: int = 1
    """Update the engines' weights every this many steps (versions == steps only when 1)."""
    save_interval: int | None = None
    """Save every this many steps (always at the end)."""
    eval_interval: int | None = None
    """Evaluate every this many steps (and before the first step and at the end when set)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_groups", "samples_per_prompt", "update_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSettings:
    """The driver's knobs; the trainer's are nested as the trainer builds them."""

    schedule: Schedule
    """Steps, batch, intervals (both loops)."""
    seed: int
    """Run seed (spec.data.seed): data order, sampling seeds, random init."""
    temperature: float
    """Rollout sampling temperature."""
    top_p: float
    """Rollout nucleus mass."""
    max_new_tokens: int
    """Most tokens per reply."""
    eval_temperature: float
    """Sampling temperature of evaluation (0 = greedy)."""
    trainer: TrainerSettings
    """The trainer side's knobs (learning rates, SFT warm start, loss)."""
    max_groups_per_step: int | None = None
    """Dynamic sampling (spec.algorithm.dynamicSampling): most groups generated per step, dropped
    groups without a reward spread included; None trains every group generated."""


def settings_from_job(job: RLJob, steps: int | None = None) -> RunSettings:
    """Read the driver's knobs from `job`; `steps` (the --steps flag) overrides spec.schedule.steps."""
    spec = job.spec
    sampling = spec.rollout.sampling
    steps = steps if steps is not None else spec.schedule.steps
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    return RunSettings(
        schedule=Schedule(
            steps=steps,
            batch_groups=spec.algorithm.batch_size,
            samples_per_prompt=spec.algorithm.samples_per_prompt,
            update_interval=spec.weight_sync.update_interval,
            save_interval=spec.schedule.save_interval,
            eval_interval=spec.schedule.eval_interval,
        ),
        seed=spec.data.seed,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_new_tokens=sampling.max_new_tokens,
        eval_temperature=spec.schedule.eval_temperature,
        trainer=TrainerSettings.from_job(job),  # refuses temperature <= 0
        max_groups_per_step=(
            spec.algorithm.dynamic_sampling.max_groups_per_step if spec.algorithm.dynamic_sampling else None
        ),
    )
