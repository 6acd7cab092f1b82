"""TrainerParts: what the trainer-side steps run on, built once per process; the SFT warm start's rows.

Why it exists: the local trainer (`lockstep run`) and rank 0 of a trainer group build the same parts
from the same TrainerConfig: the backend (built by the caller), the weight transport to the engines and
the engine set each update reaches, the task and its text functions. lockstep.trainer.local runs the
steps on them.

Who calls it: lockstep.driver.policy (a local run), lockstep.trainer.server (rank 0),
lockstep.trainer.local (the steps), lockstep.trainer.standalone (SftRows).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.models.hub_data import resolve_data
from lockstep.serving.membership import EngineMembers, StaticMembers
from lockstep.tasks import Task, TaskItem, data_task
from lockstep.trainer.settings import TrainerConfig, TrainerSettings
from lockstep.weights.factory import build_transport
from lockstep.weights.transport import EngineSet

if TYPE_CHECKING:
    from lockstep.train.backend import TrainBackend
    from lockstep.weights.inprocess import Handoff
    from lockstep.weights.transport import WeightTransport

SFT_ITEM_BASE = 10_000_000
"""SFT warm-start items are drawn from this train-split offset, apart from the RL prompts."""


@dataclass(slots=True)
class TrainerParts:
    """Everything the trainer-side steps need; built once per process."""

    settings: TrainerSettings
    """Learning rates, SFT warm start, loss, seed, pre-flight and offload switches."""
    run_dir: Path
    """Where checkpoints/ and preflight.json are written (the trainer's run dir)."""
    backend: TrainBackend
    """The sharded policy (on rank 0 of a group: lockstep.trainer.spmd.LeaderBackend)."""
    transport: WeightTransport
    """How versions reach the engines."""
    engines: EngineSet
    """The engines each update reaches (asked again before every update)."""
    pad_id: int
    """Padding token ID for packing."""
    eos_id: int
    """The token that ends an assistant turn (closes each SFT answer)."""
    engine_urls: list[str]
    """The engines known at start (each update and the pre-flight ask `engines` for those of the moment)."""
    render: Callable[[Sequence[Mapping[str, Any]]], list[int]]
    """Chat messages -> prompt token IDs (with the generation prompt), as the rollout renders them."""
    encode: Callable[[str], list[int]]
    """Text -> token IDs (SFT answers)."""
    task: Task
    """Prompts and reference answers (SFT warm start, pre-flight probe prompt)."""
    reply_pair: Callable[..., tuple[list[int], list[int]]] | None = None
    """ChatTokenizer.reply_pair: an item's reference assistant message (a shell task's reference tool
    call, metadata "reference_reply") -> (prompt IDs, reply IDs) for the SFT warm start."""
    clock: Callable[[], float] = time.monotonic
    """Injected monotonic clock (step timings)."""


@dataclass(slots=True)
class SftRows:
    """The SFT warm start's rows: items from a train-split offset (SFT_ITEM_BASE) so RL prompts are not
    the ones just imitated; each row is (prompt, reference answer + end of turn). The one definition for
    the warm start of a run and for `lockstep trainer` without --serve."""

    task: Task
    render: Callable[[Sequence[Mapping[str, Any]]], list[int]]
    encode: Callable[[str], list[int]]
    eos: list[int]
    reply_pair: Callable[..., tuple[list[int], list[int]]] | None = None

    def step(
        self, k: int, rows: int, *, rank: int = 0, world_size: int = 1
    ) -> list[tuple[list[int], list[int]]]:
        """Step k's rows (`rows` of them over all ranks); this rank's slice of them (data parallel)."""
        first = SFT_ITEM_BASE + k * rows
        return [self.pair(self.task.item(i, "train")) for i in range(first + rank, first + rows, world_size)]

    def pair(self, item: TaskItem) -> tuple[list[int], list[int]]:
        """(prompt, answer + end of turn) of one SFT row: the reference reply through the chat template
        when the item has one (a tool call), else the answer text."""
        reply = item.metadata.get("reference_reply")
        if reply is not None and self.reply_pair is not None:
            prompt, answer = self.reply_pair(item.messages, reply, item.metadata.get("reference_tools"))
            return prompt, answer + self.eos
        return self.render(item.messages), self.encode(item.answer) + self.eos


def build_trainer_parts(
    config: TrainerConfig,
    run_dir: Path,
    model_dir: Path,
    backend: TrainBackend,
    engine_urls: Sequence[str],
    closers: list[Callable[[], None]],
    master_address: str = "127.0.0.1",
    members: EngineMembers | None = None,
    *,
    handoffs: Sequence[Handoff] = (),
) -> TrainerParts:
    """The trainer side of a run: the transport to the engines `engine_urls` (ready now), the task's
    text functions.

    `closers` receives the transport's close (the caller already owns the backend's);
    `master_address` is where engines reach this process (broadcast's weight-update group);
    `members` is where each update finds the engines of the moment (default: exactly `engine_urls`; a
    trainer group in a cluster: the pool's headless Service, lockstep.serving.membership);
    `handoffs` are the engines embedded in this process (the in-process transport of `auto`).
    """
    tokenizer = config.model.load_tokenizer(model_dir)
    task = data_task(resolve_data(config.data))
    device = str(getattr(backend, "device_type", "cpu"))
    urls = sorted(u.rstrip("/") for u in engine_urls)
    transport = build_transport(
        config.transport, run_dir, model_dir, urls, device, master_address, handoffs=handoffs
    )
    closers.append(transport.close)
    return TrainerParts(
        settings=config.settings,
        run_dir=Path(run_dir),
        backend=backend,
        transport=transport,
        engines=EngineSet(members or StaticMembers(tuple(urls)), urls),
        pad_id=tokenizer.pad_token_id,
        eos_id=tokenizer.eos_token_id,
        engine_urls=[u.rstrip("/") for u in engine_urls],
        render=lambda msgs: tokenizer.render(msgs, add_generation_prompt=True),
        encode=tokenizer.encode,
        task=task,
        reply_pair=tokenizer.reply_pair,
    )
