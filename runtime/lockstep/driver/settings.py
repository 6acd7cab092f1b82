"""RunSettings: the knobs of one run, read once from the RLJob (a pure function, golden-tested).

Why it exists: the loop should read plain, validated numbers, not walk the manifest. `settings_from_job`
is the one place that maps manifest fields to the driver's knobs; the trainer's knobs are nested as
they are built for the trainer side (lockstep.trainer.settings.TrainerSettings), never copied.

Who calls it: lockstep.driver.components.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lockstep.trainer.settings import TrainerSettings

if TYPE_CHECKING:
    from lockstep.api import RLJob


@dataclass(frozen=True, slots=True)
class RunSettings:
    """Plain numbers the loop reads."""

    steps: int
    """Optimizer steps to reach (a resumed run continues up to this)."""
    batch_groups: int
    """Groups per step (spec.algorithm.batchSize)."""
    samples_per_prompt: int
    """Samples per group."""
    seed: int
    """Run seed (spec.data.seed): data order, sampling seeds, random init."""
    save_interval: int | None
    """Save every this many steps (always at the end)."""
    eval_interval: int | None
    """Evaluate every this many steps (and before the first step and at the end when set)."""
    update_interval: int
    """Publish weights every this many steps."""
    temperature: float
    """Rollout sampling temperature."""
    top_p: float
    """Rollout nucleus mass."""
    max_new_tokens: int
    """Most tokens per reply."""
    eval_temperature: float
    """Sampling temperature of evaluation (0 = greedy)."""
    trainer: TrainerSettings
    """The trainer side's knobs (learning rates, SFT warm start, loss), as the trainer builds them."""


def settings_from_job(job: RLJob, steps: int | None = None) -> RunSettings:
    """Read the loop's knobs from `job`; `steps` (the --steps flag) overrides spec.schedule.steps."""
    spec = job.spec
    sampling = spec.rollout.sampling
    steps = steps if steps is not None else spec.schedule.steps
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    return RunSettings(
        steps=steps,
        batch_groups=spec.algorithm.batch_size,
        samples_per_prompt=spec.algorithm.samples_per_prompt,
        seed=spec.data.seed,
        save_interval=spec.schedule.save_interval,
        eval_interval=spec.schedule.eval_interval,
        update_interval=spec.weight_sync.update_interval,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_new_tokens=sampling.max_new_tokens,
        eval_temperature=spec.schedule.eval_temperature,
        trainer=TrainerSettings.from_job(job),  # refuses temperature <= 0
    )
