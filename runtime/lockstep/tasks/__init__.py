"""Tasks: where prompts come from and how a finished answer is scored.

Why it exists: the driver needs, for every group, a prompt (chat messages) and a verifiable reward.
A task is deterministic by index (`item(i)`), so the data position of a run is one integer and a
resumed run draws exactly the prompts it would have drawn. Tasks know nothing about tokens: the
rollout layer renders messages with the model family's chat format.

Built-in tasks (`data.prompts: builtin:<name>`):
- `builtin:reverse`: reverse a string of 3 to 5 digits; exact-match reward (see digits.py).
- `builtin:toolcalc`: a multi-turn arithmetic task answered through the `calc` tool (see toolcalc/).
The table is lockstep.tasks.registry.BUILTIN_TASKS.
User data is also accepted: a JSON-lines file or directory, or a local Hugging Face dataset (schema
and forms in lockstep.tasks.data). Its default reward is the math reward (lockstep.tasks.numeric) when
every label is a number, else exact match after stripping whitespace.

Who calls it: lockstep.driver.inputs (prompt source, eval set, default reward), lockstep.trainer.parts
(the SFT warm start's answers), the in-process session server (lockstep.rollout.session.local),
`lockstep trainer` and `lockstep precision-check`.
"""

from lockstep.tasks.base import Task, TaskItem
from lockstep.tasks.registry import data_task, load_task

__all__ = ["Task", "TaskItem", "data_task", "load_task"]
