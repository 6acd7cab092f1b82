"""The `Trainer` protocol: the driver's view of the policy, and the errors a trainer raises.

Why it exists: the driver owns the loop; the trainer owns the policy (train steps, weight updates,
checkpoints). The loop talks to it only through this protocol, so the same loop drives a trainer in
its own process (lockstep.trainer.local.LocalTrainer) or a trainer group's ranks over HTTP
(lockstep.driver.remote.RemoteTrainer). Both sides import this module, so it sits in the trainer
layer, below the driver. The calls are coarse on purpose: one call is one line of the loop and one
collective command of all trainer ranks; weights never travel through the driver.

Who calls it: lockstep.driver (loops, components, remote), lockstep.trainer (local, server).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lockstep.trainer.state import DriverState
    from lockstep.types import Group
    from lockstep.weights.preflight import PreflightResult


class NonFiniteLoss(RuntimeError):
    """The loss or gradient norm was NaN/inf; the step was not applied."""


class PreflightFailed(RuntimeError):
    """check-weight-update-equal found engines that do not hold the trainer's weights."""

    def __init__(self, message: str, result: PreflightResult | None = None) -> None:
        super().__init__(message)
        self.result = result
        """The full result (differing tensors), carried to the driver when the check ran elsewhere."""


class Trainer(Protocol):
    """The policy, as the loop sees it. Every call is one step of the loop (§1)."""

    def warm_start(self) -> Iterator[dict[str, float]]:
        """Run the SFT warm start (spec.algorithm.sftWarmStart.steps steps); yield each step's metrics."""
        ...

    def first_update(self, version: int) -> dict[str, float]:
        """Push the loaded weights as `version` before step 1 (through the pre-flight check when the
        manifest asks). Raises PreflightFailed naming the differing tensors."""
        ...

    def train(self, groups: list[Group]) -> dict[str, float]:
        """One RL optimizer step on complete groups; the step's metrics. Raises NonFiniteLoss."""
        ...

    def update_weights(self, version: int) -> dict[str, float]:
        """Push the current weights to every engine as `version`; the update's metrics."""
        ...

    def save(self, state: DriverState) -> str:
        """Checkpoint the policy with the loop's `state` beside it; returns where (for logs)."""
        ...

    def load_latest(self) -> DriverState | None:
        """Restore the latest checkpoint; the DriverState saved with it, or None when there is none."""
        ...

    def where(self) -> str:
        """Where the checkpoints are (named in errors and logs)."""
        ...

    def shutdown(self) -> None:
        """The job is done: a remote trainer group's ranks exit 0 (nothing for a local trainer)."""
        ...

    def close(self) -> None:
        """Release this handle (a remote trainer's connection); the policy stays where it lives."""
        ...


class ServedTrainer(Trainer, Protocol):
    """The trainer a trainer group's rank 0 serves (lockstep.trainer.server): it also keeps the
    pre-flight result of its last first update, which the driver mirrors into its own run dir."""

    def preflight_result(self) -> PreflightResult | None:
        """The last first update's pre-flight result (None when the check did not run)."""
        ...
