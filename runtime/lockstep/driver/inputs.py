"""A run's inputs: the checkpoint resolved, its tokenizer and the task of its data.

Why it exists: the RL run (components.py) and the SFT run (sft.py) start from the same three things,
read from the same RunConfig; one function builds them for both.

Who calls it: lockstep.driver.components, lockstep.driver.sft.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lockstep.config.driver import RunConfig
from lockstep.models import ChatTokenizer, load_tokenizer, resolve_checkpoint
from lockstep.models.hub_data import resolve_data
from lockstep.models.moe import routing_shape
from lockstep.tasks import Task, data_task


@dataclass(frozen=True, slots=True)
class RunInputs:
    """The initial checkpoint, its chat tokenizer and the task of the job's data."""

    model_dir: Path
    """The initial HF checkpoint (resolved from spec.model.checkpoint)."""
    tokenizer: ChatTokenizer
    """The checkpoint's tokenizer with the family's chat format."""
    task: Task
    """Prompts (or an SFT job's rows) and the default reward."""


def load_inputs(config: RunConfig, cache_dir: Path | None) -> RunInputs:
    """Resolve the checkpoint (materializing a builtin one), check R3 against it, load the tokenizer
    and the data."""
    source = config.trainer.model
    model_dir = resolve_checkpoint(source.checkpoint, cache_dir=cache_dir, seed=config.settings.seed)
    check_r3_model(config, model_dir)
    tokenizer = load_tokenizer(model_dir, source.tokenizer, source.chat_template, cache_dir)
    return RunInputs(model_dir, tokenizer, data_task(resolve_data(config.trainer.data), sft=config.sft))


def check_r3_model(config: RunConfig, model_dir: Path) -> None:
    """R3 replays MoE routing: refuse it on a dense checkpoint, naming the field and the fix."""
    if config.r3 and routing_shape(model_dir) is None:
        raise ValueError(
            f"spec.algorithm.r3: {config.trainer.model.checkpoint} is a dense model (its config.json has no "
            "num_experts / num_experts_per_tok); R3 replays MoE routing: set r3: false"
        )
