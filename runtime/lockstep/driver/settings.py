"""RunSettings: the knobs of one local run, read once from the RLJob (a pure function, golden-tested).

Why it exists: the loop should read plain, validated numbers, not walk the manifest. `settings_from_job`
is the one place that maps manifest fields to loop knobs, including the local-run ones:
spec.algorithm.sftWarmStart {steps, learningRate}, spec.trainer.gradClip and microBatchSize, and
spec.schedule.evalTemperature (all typed and range-checked by lockstep.api).

Who calls it: lockstep.driver.components.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

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
    learning_rate: float
    """AdamW learning rate of RL steps."""
    temperature: float
    """Rollout sampling temperature."""
    top_p: float
    """Rollout nucleus mass."""
    max_new_tokens: int
    """Most tokens per reply."""
    sft_steps: int = 0
    """SFT warm-start steps (0 = none)."""
    sft_learning_rate: float | None = None
    """SFT learning rate (None = learning_rate)."""
    grad_clip: float = 1.0
    """Max gradient norm."""
    micro_batch_size: int = 64
    """Rows per forward/backward."""
    eval_temperature: float = 0.0
    """Sampling temperature of evaluation (0 = greedy)."""


def settings_from_job(job: RLJob, steps: int | None = None) -> RunSettings:
    """Read the loop's knobs from `job`; `steps` (the --steps flag) overrides spec.schedule.steps."""
    spec = job.spec
    sampling = spec.rollout.sampling
    s = RunSettings(
        steps=steps if steps is not None else spec.schedule.steps,
        batch_groups=spec.algorithm.batch_size,
        samples_per_prompt=spec.algorithm.samples_per_prompt,
        seed=spec.data.seed,
        save_interval=spec.schedule.save_interval,
        eval_interval=spec.schedule.eval_interval,
        update_interval=spec.weight_sync.update_interval,
        learning_rate=spec.algorithm.learning_rate,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_new_tokens=sampling.max_new_tokens,
        sft_steps=spec.algorithm.sft_warm_start.steps,
        sft_learning_rate=spec.algorithm.sft_warm_start.learning_rate,
        grad_clip=spec.trainer.grad_clip,
        micro_batch_size=spec.trainer.micro_batch_size,
        eval_temperature=spec.schedule.eval_temperature,
    )
    if s.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {s.steps}")
    if s.temperature <= 0:
        raise ValueError(
            "spec.rollout.sampling.temperature: RL needs temperature > 0 (logprobs of greedy decoding are "
            "not a sampling distribution); use 1.0"
        )
    return s
