"""The built-in tasks by name: what `data.prompts: builtin:<name>` can say.

Why it exists: one table that `load_task` (here) reads and that error messages list, so adding a
built-in task is one line here and never touches the loader.

- `builtin:reverse`: reverse 3 to 5 digits, exact-match reward (lockstep.tasks.digits).
- `builtin:toolcalc`: "calc 12+7", answered by calling the `calc` tool and then the number; a
  multi-turn TITO task (lockstep.tasks.toolcalc). Its own reward is exact match of the final text;
  run it with spec.agent.agentFunction `lockstep.rollout.session.local:toolcalc_agent` and
  rewardFunction `lockstep.tasks.toolcalc:reward` (examples/tiny-tools.yaml).
- `builtin:shell`: one-command shell tasks (make a file, write a number, copy, move, ...) scored by
  their test scripts in a sandbox; run it with spec.agent.sandbox (lockstep.tasks.shell,
  examples/tiny-sandbox.yaml).

Who calls it: lockstep.tasks.load_task's callers (the driver, the trainer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from lockstep.tasks.base import DataTask, Task
from lockstep.tasks.data import read_rows
from lockstep.tasks.digits import ReverseDigits
from lockstep.tasks.shell.suite import ShellSuite
from lockstep.tasks.toolcalc.env import ToolCalc

if TYPE_CHECKING:
    from lockstep.api import DataSpec

BUILTIN_TASKS: dict[str, Callable[[int], Task]] = {
    "reverse": ReverseDigits,
    "toolcalc": ToolCalc,
    "shell": ShellSuite,
}
"""Built-in task names (used as `builtin:<name>`) and their constructors (taking the data seed)."""


def data_task(data: DataSpec, *, sft: bool = False) -> Task:
    """The Task of a job's spec.data: its prompts, eval prompts, seed and shuffle (`sft`: an SFT job's
    rows, lockstep.tasks.data)."""
    return load_task(data.prompts, data.eval_prompts, data.seed, shuffle=data.shuffle, sft=sft)


def load_task(
    source: str, eval_source: str | None = None, seed: int = 0, *, shuffle: bool = False, sft: bool = False
) -> Task:
    """A Task from a manifest's data.prompts (and data.evalPrompts) string.

    `seed` is spec.data.seed; `shuffle` (spec.data.shuffle) reorders user data every epoch under it
    (lockstep.tasks.base.epoch_order). A built-in task draws each prompt from (seed, index) already.
    Raises ValueError naming the unknown built-in and the known ones.
    """
    if source.startswith("builtin:"):
        name = source.removeprefix("builtin:")
        if name not in BUILTIN_TASKS:
            raise ValueError(
                f"data.prompts: unknown built-in task {source!r}; known: "
                + ", ".join(f"builtin:{k}" for k in sorted(BUILTIN_TASKS))
            )
        if eval_source is not None and eval_source != source:
            raise ValueError(
                f"data.evalPrompts: a built-in task evaluates on its own eval split; set it to {source!r}"
            )
        return BUILTIN_TASKS[name](seed)
    eval_rows = read_rows(eval_source, sft=sft) if eval_source else None
    return DataTask(source, read_rows(source, sft=sft), eval_rows, shuffle_seed=seed if shuffle else None)
