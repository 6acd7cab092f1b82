"""SFTTrainer: the trainer side of an SFT job (spec.recipe sft): the same backend, no engines.

Why it exists: §8, supervised fine-tuning reuses the trainer, its parallelism and its checkpoints without
a rollout engine. An SFT job's step is one optimizer step of `sft_loss` (the token-mean NLL) on rows the
driver tokenized with their assistant-only loss mask (lockstep.models.assistant_mask); checkpoints,
resume and the learning-rate schedule are the RL trainer's (lockstep.trainer.state,
lockstep.train.common.lr_schedule). It answers the same protocol as LocalTrainer, so rank 0 of a trainer
group serves it unchanged (lockstep.trainer.server); the commands that need engines (warm start, first
update, RL train, weight update) are refused naming the recipe, since an SFT job has none.

Who calls it: lockstep.driver.policy (in the driver's process), lockstep.trainer.server (rank 0 of an SFT
job's trainer group).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lockstep.train.common.losses import sft_loss
from lockstep.train.common.lr_schedule import learning_rate_at
from lockstep.train.common.packing import pack_masked
from lockstep.trainer.protocol import NonFiniteLoss
from lockstep.trainer.state import DriverState, checkpoints_dir, latest_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from lockstep.train.backend import TrainBackend
    from lockstep.trainer.settings import TrainerSettings
    from lockstep.types import Group
    from lockstep.weights.preflight import PreflightResult

SFTRow = tuple[Sequence[int], Sequence[int]]
"""(token IDs of a conversation, its loss mask per token)."""


class NoEngines(ValueError):
    """An engine command sent to an SFT job's trainer."""


@dataclass(slots=True)
class SFTTrainer:
    """The SFT steps over a backend (see the module doc)."""

    backend: TrainBackend
    """The sharded policy (on rank 0 of a group: lockstep.trainer.spmd.LeaderBackend)."""
    settings: TrainerSettings
    """Learning rate and its schedule over schedule.steps."""
    run_dir: Path
    """Where checkpoints/ are written."""
    pad_id: int
    """Padding token ID."""
    clock: Callable[[], float] = time.monotonic
    """Injected monotonic clock (tokens/s)."""
    steps: int = 0
    """SFT optimizer steps done (restored by load_latest): the schedule's position."""

    def sft_train(self, rows: Sequence[SFTRow]) -> dict[str, float]:
        """One optimizer step of the token-mean NLL on the rows' masked tokens; NonFiniteLoss when it
        could not be applied (weights unchanged)."""
        lr = learning_rate_at(self.settings.lr_schedule, self.steps + 1)
        self.backend.set_learning_rate(lr)
        batch = pack_masked(rows, self.pad_id)
        t0 = self.clock()
        result = self.backend.train_step(batch, sft_loss)
        seconds = max(self.clock() - t0, 1e-9)
        if result.skipped:
            raise NonFiniteLoss(
                f"non-finite SFT loss ({result.loss}) or gradient norm ({result.grad_norm}); the step was not applied"
            )
        self.steps += 1
        tokens = int(batch.attention_mask.sum().item())
        return {
            **result.metrics,
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "learning_rate": lr,
            "train_tokens": float(result.tokens),
            "sft_rows": float(len(rows)),
            "sft_sequence_tokens": float(tokens),
            "sft_tokens_per_s": tokens / seconds,
            "time_train_s": seconds,
        }

    def save(self, state: DriverState) -> str:
        return str(save_checkpoint(self.backend, self.run_dir, state))

    def load_latest(self) -> DriverState | None:
        path = latest_checkpoint(self.run_dir)
        if path is None:
            return None
        state = DriverState.from_dict(self.backend.load(path))
        self.steps = state.step
        return state

    def where(self) -> str:
        return str(checkpoints_dir(self.run_dir))

    def preflight_result(self) -> PreflightResult | None:
        return None  # no engines, no pre-flight

    def shutdown(self) -> None:
        """Nothing to end here (a group's ranks exit after the command)."""

    def close(self) -> None:
        """The backend is closed by whoever built it."""

    # An SFT job has no engines: the RL loop's engine commands are not part of it.
    def warm_start(self) -> Iterator[dict[str, float]]:
        raise NoEngines("warm_start: this is an SFT job (spec.recipe sft); it has no SFT warm start")

    def first_update(self, version: int) -> dict[str, float]:
        raise NoEngines("first_update: an SFT job (spec.recipe sft) has no engines to update")

    def train(self, groups: list[Group]) -> dict[str, float]:
        raise NoEngines("train: an SFT job (spec.recipe sft) trains with sft_train, not on rollout groups")

    def update_weights(self, version: int) -> dict[str, float]:
        raise NoEngines("update_weights: an SFT job (spec.recipe sft) has no engines to update")
