"""The trainer side's configs: TrainerSettings (its knobs) and TrainerConfig (what builds a trainer process).

Why it exists: the trainer runs in the driver's process (`lockstep run`) or on the ranks of a trainer
group, and both build it from the same typed config, made once from the manifest by
lockstep.config.trainer (the one place that reads those manifest fields). Nothing here reads an RLJob.
API enums stay enums (PolicyLossConfig takes them as they are).

Who calls it: lockstep.config.trainer (builds them), lockstep.trainer.local and lockstep.trainer.server
(run on them), lockstep.config.driver (RunSettings nests the same object), lockstep.cli.trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lockstep.api import DataSpec
    from lockstep.models import ModelSource
    from lockstep.train.backend import BackendConfig
    from lockstep.train.common.losses import PolicyLossConfig
    from lockstep.train.common.lr_schedule import LRSchedule
    from lockstep.weights.factory import TransportConfig


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
    check_weight_update_equal: bool = False
    """Run the first update through the pre-flight check (spec.weightSync.checkWeightUpdateEqual)."""
    engine_checksums: bool = True
    """The pre-flight compares checksums the trainer computes too: true against the reference engine
    (HF names, hashed on the CPU), false against SGLang (fused, sharded; its own compare decides)."""
    allow_quant_error: bool = False
    """The pre-flight allows the shared quantizer's error (low-precision serving, spec.rollout.precision)."""
    offload_between_steps: bool = False
    """Move the trainer's state off the device after each update (spec.trainer.offload other than none)."""
    sft_job: bool = False
    """An SFT job (spec.recipe sft): no engines, no transport; the steps are lockstep.trainer.sft's."""
    opd_coef: float | None = None
    """OPD's beta (spec.algorithm.opd.coef): A_t - beta * d_t after the estimator; None without OPD."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerConfig:
    """Everything a trainer process (the local trainer, or the ranks of a trainer group) is built from."""

    job_name: str
    """metadata.name: a trainer group answers only its own job's driver."""
    model: ModelSource
    """The checkpoint and tokenizer (spec.model)."""
    data: DataSpec
    """The prompts (spec.data): the SFT warm start's answers and the pre-flight probe."""
    settings: TrainerSettings
    """The trainer's knobs."""
    backend: BackendConfig
    """The sharded policy: an FSDPConfig or a MegatronConfig without its model_path yet."""
    transport: TransportConfig
    """How versions reach the engines."""
    world_size: int = 1
    """Ranks the manifest asks for (spec.trainer.nodes x gpusPerNode); a different torchrun world is logged."""
