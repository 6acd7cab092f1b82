"""Shell tasks: an instruction, an optional setup script and a test script, run in a sandbox.

Why it exists: agentic RL scores an episode by the task's own test script in the environment the
model acted in (§9; the terminal-bench / Harbor task shape). A shell task is data: `rows` reads
it from a job's prompt source (JSON lines with `instruction`, `setup`, `test`, optional `solution`),
`suite` is the small built-in suite (`builtin:shell`) the tiny model learns, `SH_TOOL` is the one tool
the terminal agent offers the model, and `reward` reads the test's verdict the agent stored.

Who calls it: lockstep.tasks.data (rows), lockstep.tasks.registry (`builtin:shell`), the terminal
agent (lockstep.rollout.terminal), the driver (the default reward of a sandbox job).
"""

from lockstep.tasks.shell.rows import (
    SANDBOX_KEY,
    SH_TOOL,
    is_task_row,
    reference_reply,
    reward,
    task_row,
)
from lockstep.tasks.shell.suite import ShellSuite

__all__ = ["SANDBOX_KEY", "SH_TOOL", "ShellSuite", "is_task_row", "reference_reply", "reward", "task_row"]
