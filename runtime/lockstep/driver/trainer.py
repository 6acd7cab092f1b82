"""The driver's view of "the trainer": a few coarse calls that match the loop's lines, in or out of process.

Why it exists: the driver owns the loop and the buffer (rollout, eval, progress, staleness); the
trainer owns the policy (train steps, weight pushes to the engines, checkpoints). The loop talks to
the trainer only through the `Trainer` protocol, so the same loop runs

- `LocalTrainer`: the policy in this process (`lockstep run`, a driver without a trainer URL): the
  FSDP2 backend as one rank plus the functions of lockstep.driver.steps, exactly as before;
- `RemoteTrainer` (lockstep.driver.remote): the TrainerGroup's ranks in a cluster, reached over HTTP at
  rank 0 (`lockstep trainer --serve`, lockstep.driver.trainer_server).

The calls are coarse on purpose: weights never travel through the driver (a push goes trainer ->
engines directly), and one call is one collective command of all trainer ranks.

`TrainerParts` is what the trainer side needs to run those calls (backend, transport, loss, the
task's text functions for the SFT warm start and the pre-flight probe); both the local trainer and the
rank-0 server build one with `build_trainer_parts`.

Who calls it: lockstep.driver.components (builds the trainer), lockstep.driver.loop and
lockstep.driver.fully_async (call it), lockstep.driver.trainer_server (rank 0 wraps a LocalTrainer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lockstep.driver.state import DriverState, checkpoints_dir, latest_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from lockstep.api import RLJob
    from lockstep.driver.membership import EngineMembers
    from lockstep.driver.settings import RunSettings
    from lockstep.serving.client import EngineClient
    from lockstep.serving.loop import LoopThread
    from lockstep.tasks import Task
    from lockstep.train.backend import TrainBackend
    from lockstep.train.common.losses import PolicyLossConfig
    from lockstep.types import Group
    from lockstep.weights.preflight import PreflightResult
    from lockstep.weights.transport import WeightTransport


class Trainer(Protocol):
    """The policy, as the loop sees it. Every call is one step of the loop (seed §1)."""

    def warm_start(self) -> Iterator[dict[str, float]]:
        """Run the SFT warm start (settings.sft_steps steps); yield each step's metrics."""
        ...

    def first_push(self, version: int) -> dict[str, float]:
        """Push the loaded weights as `version` before step 1 (through the pre-flight check when the
        manifest asks). Raises PreflightFailed naming the differing tensors."""
        ...

    def train(self, groups: list[Group]) -> dict[str, float]:
        """One RL optimizer step on complete groups; the step's metrics. Raises NonFiniteLoss."""
        ...

    def push(self, version: int) -> dict[str, float]:
        """Publish the current weights to every engine as `version`; the push's metrics."""
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
    """The trainer a trainer group's rank 0 serves (lockstep.driver.trainer_server): it also keeps the
    pre-flight result of its last first push, which the driver mirrors into its own run dir."""

    def preflight_result(self) -> PreflightResult | None:
        """The last first push's pre-flight result (None when the check did not run)."""
        ...


@dataclass(slots=True)
class TrainerParts:
    """Everything the trainer-side steps (lockstep.driver.steps) need; built once per process."""

    job: RLJob
    """The validated manifest (spec.weightSync for the pre-flight)."""
    settings: RunSettings
    """Steps, learning rates, SFT warm start, seed."""
    run_dir: Path
    """Where checkpoints/ and preflight.json are written (the trainer's run dir)."""
    backend: TrainBackend
    """The sharded policy (on rank 0 of a group: lockstep.driver.spmd.LeaderBackend)."""
    transport: WeightTransport
    """How versions reach the engines."""
    loss: PolicyLossConfig
    """The RL loss settings."""
    pad_id: int
    """Padding token ID for packing."""
    engine_urls: list[str]
    """The engines known at start (the pre-flight reads them back); each push asks the membership again."""
    render: Callable[[Sequence[Mapping[str, Any]]], list[int]]
    """Chat messages -> prompt token IDs (with the generation prompt), as the rollout renders them."""
    encode: Callable[[str], list[int]]
    """Text -> token IDs (SFT answers)."""
    task: Task
    """Prompts and reference answers (SFT warm start, pre-flight probe prompt)."""
    clock: Callable[[], float] = time.monotonic
    """Injected monotonic clock (step timings)."""


class LocalTrainer:
    """The Trainer in this process: today's behaviour of `lockstep run` (and rank 0 of a trainer group)."""

    def __init__(self, parts: TrainerParts) -> None:
        self.parts = parts
        """The backend, transport and task functions the steps run on."""

    def warm_start(self) -> Iterator[dict[str, float]]:
        from lockstep.driver.steps import sft_warm_start

        yield from sft_warm_start(self.parts)

    def first_push(self, version: int) -> dict[str, float]:
        from lockstep.driver.steps import first_push

        return first_push(self.parts, version)

    def train(self, groups: list[Group]) -> dict[str, float]:
        from lockstep.driver.steps import train_on_groups

        return train_on_groups(self.parts, groups)

    def push(self, version: int) -> dict[str, float]:
        from lockstep.driver.steps import push_weights

        return push_weights(self.parts, version)

    def save(self, state: DriverState) -> str:
        return str(save_checkpoint(self.parts.backend, self.parts.run_dir, state))

    def load_latest(self) -> DriverState | None:
        path = latest_checkpoint(self.parts.run_dir)
        if path is None:
            return None
        return DriverState.from_dict(self.parts.backend.load(path))

    def preflight_result(self) -> PreflightResult | None:
        """The pre-flight result the last first_push wrote (None when the check did not run)."""
        from lockstep.driver.steps import PREFLIGHT_FILE
        from lockstep.weights.preflight import PreflightResult

        path = self.parts.run_dir / PREFLIGHT_FILE
        return PreflightResult.model_validate_json(path.read_text()) if path.is_file() else None

    def where(self) -> str:
        """Where checkpoints live (named in errors)."""
        return str(checkpoints_dir(self.parts.run_dir))

    def shutdown(self) -> None:
        """Nothing to end: this process is the trainer."""

    def close(self) -> None:
        """Nothing of its own: the backend and transport are closed by whoever built them."""


def build_trainer_parts(
    job: RLJob,
    settings: RunSettings,
    run_dir: Path,
    model_dir: Path,
    backend: TrainBackend,
    runner: LoopThread,
    clients: Sequence[EngineClient],
    closers: list[Callable[[], None]],
    master_address: str = "127.0.0.1",
    members: EngineMembers | None = None,
) -> TrainerParts:
    """The trainer side of a run: transport to `clients`' engines, the loss, the task's text functions.

    `closers` receives the transport's close (the caller already owns the backend's);
    `master_address` is where engines reach this process (broadcast's weight-update group);
    `members` is where each push finds the engines of the moment (default: exactly `clients`; a
    trainer group in a cluster: the pool's headless Service, lockstep.driver.membership).
    """
    from lockstep.driver.components import loss_config
    from lockstep.driver.transports import build_transport
    from lockstep.models import TinyTokenizer
    from lockstep.tasks import load_task

    tokenizer = TinyTokenizer.load(model_dir)
    task = load_task(job.spec.data.prompts, job.spec.data.eval_prompts, settings.seed)
    device = str(getattr(backend, "device_type", "cpu"))
    transport = build_transport(job, run_dir, model_dir, runner, clients, device, master_address, members)
    closers.append(transport.close)
    return TrainerParts(
        job=job,
        settings=settings,
        run_dir=Path(run_dir),
        backend=backend,
        transport=transport,
        loss=loss_config(job),
        pad_id=tokenizer.pad_token_id,
        engine_urls=[c.base_url for c in clients],
        render=lambda msgs: tokenizer.render(msgs, add_generation_prompt=True),
        encode=tokenizer.encode,
        task=task,
    )
