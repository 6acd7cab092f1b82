"""TrainerSettings: what the trainer side reads of the RLJob, built once (a pure function, golden-tested).

Why it exists: the trainer runs in the driver's process (`lockstep run`) or on the ranks of a trainer
group, and both build their knobs from the same manifest with `TrainerSettings.from_job`; the driver's
RunSettings (lockstep.driver.settings) nests the same object instead of copying its fields. API enums
stay enums (PolicyLossConfig takes them as they are).

Who calls it: lockstep.driver.settings, lockstep.trainer.server, lockstep.cli.trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lockstep.train.common.losses import PolicyLossConfig
from lockstep.train.common.lr_schedule import LRSchedule
from lockstep.train.common.mismatch import MismatchConfig

if TYPE_CHECKING:
    from lockstep.api import RLJob


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerSettings:
    """The knobs of the trainer side of one run."""

    seed: int
    """Run seed (spec.data.seed): random init, the task's data order."""
    learning_rate: float
    """AdamW learning rate of RL steps (spec.algorithm.learningRate)."""
    grad_clip: float
    """Max gradient norm (spec.trainer.gradClip)."""
    micro_batch_size: int
    """Rows per forward/backward (spec.trainer.microBatchSize)."""
    temperature: float
    """Rollout sampling temperature: the trainer's logprobs are of the same distribution."""
    sft_steps: int
    """SFT warm-start steps (0 = none)."""
    sft_learning_rate: float | None
    """SFT learning rate (None = learning_rate)."""
    sft_rows: int
    """Rows per SFT step: the RL batch's samples (batch size x samples per prompt)."""
    sft_stop_at_loss: float | None
    """End the warm start early at this mean loss of its last steps (None = all sft_steps)."""
    loss: PolicyLossConfig
    """The RL loss (spec.algorithm)."""
    lr_schedule: LRSchedule
    """The RL learning rate per step (spec.algorithm.lrSchedule over spec.schedule.steps; a --steps
    override stops the run early, it does not reshape the schedule)."""

    @classmethod
    def from_job(cls, job: RLJob) -> TrainerSettings:
        """Read the trainer's knobs from `job` (the API keeps the sampling temperature above 0)."""
        spec = job.spec
        alg = spec.algorithm
        return cls(
            seed=spec.data.seed,
            learning_rate=alg.learning_rate,
            grad_clip=spec.trainer.grad_clip,
            micro_batch_size=spec.trainer.micro_batch_size,
            temperature=spec.rollout.sampling.temperature,
            sft_steps=alg.sft_warm_start.steps,
            sft_learning_rate=alg.sft_warm_start.learning_rate,
            sft_rows=alg.batch_size * alg.samples_per_prompt,
            sft_stop_at_loss=alg.sft_warm_start.stop_at_loss,
            loss=loss_config(job),
            lr_schedule=lr_schedule(job),
        )


def loss_config(job: RLJob) -> PolicyLossConfig:
    """The RL loss settings of the manifest (spec.algorithm)."""
    alg = job.spec.algorithm
    return PolicyLossConfig(
        estimator=alg.advantage_estimator,  # StrEnums: the loss compares them with its str names
        eps_clip_low=alg.eps_clip,
        eps_clip_high=alg.eps_clip_high if alg.eps_clip_high is not None else alg.eps_clip,
        kl_coef=alg.kl.coef,
        kl_estimator=alg.kl.estimator,
        mismatch=MismatchConfig(alg.mismatch.correction, alg.mismatch.low, alg.mismatch.high),
    )


def lr_schedule(job: RLJob) -> LRSchedule:
    """The RL learning-rate schedule of the manifest (spec.algorithm.lrSchedule)."""
    alg, sched = job.spec.algorithm, job.spec.algorithm.lr_schedule
    return LRSchedule(
        learning_rate=alg.learning_rate,
        total_steps=job.spec.schedule.steps,
        warmup_steps=sched.warmup_steps,
        decay=sched.decay.value,
        min_learning_rate=sched.min_learning_rate,
    )
