"""The built-in tasks by name: what `data.prompts: builtin:<name>` can say.

Why it exists: one table that `load_task` reads and that error messages list, so adding a built-in
task is one line here and never touches the loader.

- `builtin:reverse`: reverse 3 to 5 digits, exact-match reward (lockstep.tasks.digits).
- `builtin:toolcalc`: "calc 12+7", answered by calling the `calc` tool and then the number; a
  multi-turn TITO task (lockstep.tasks.toolcalc). Its own reward is exact match of the final text;
  run it with spec.agent.agentFunction `lockstep.rollout.session.local:toolcalc_agent` and
  rewardFunction `lockstep.tasks.toolcalc:reward` (examples/tiny-tools.yaml).

Who calls it: lockstep.tasks.base.load_task.
"""

from __future__ import annotations

from collections.abc import Callable

from lockstep.tasks.base import Task
from lockstep.tasks.digits import ReverseDigits
from lockstep.tasks.toolcalc.env import ToolCalc

BUILTIN_TASKS: dict[str, Callable[[int], Task]] = {"reverse": ReverseDigits, "toolcalc": ToolCalc}
"""Built-in task names (used as `builtin:<name>`) and their constructors (taking the data seed)."""
