"""The shell-task row, the `sh` tool and the test-script reward.

Row (one JSON object per line of a prompt source, or a dataset's columns):
- `instruction` (string, required): what the model is asked to do; its prompt is one user message;
- `test` (string, required): a shell script run in the sandbox after the episode; exit status 0 is
  reward 1.0, anything else 0.0;
- `setup` (string, optional): a shell script run in the fresh sandbox before the first turn (a failing
  setup aborts the sample: the environment, not the model, is broken);
- `solution` (string, optional): a reference command; the SFT warm start imitates it as an `sh` tool
  call (`reference_reply`), and tests check every built-in task is solved by its own solution.
Other columns go to the item's metadata.

Reward: `reward(sample, response)` reads what the terminal agent stored under
sample.metadata[SANDBOX_KEY] (the test's exit status); a sample without it (the agent never reached
the test) scores 0.0.

Who calls it: lockstep.tasks.data (row_from hands shell rows here), the terminal agent, the driver.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from lockstep.tasks.base import Row

SANDBOX_KEY: Final = "sandbox"
"""Key of the episode's summary in Sample.metadata (written by the terminal agent)."""

SH_TOOL: Final[dict[str, Any]] = {
    "type": "function",
    "function": {
        "name": "sh",
        "description": "Run one shell command in the task's sandbox; returns its output and exit status.",
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string", "description": "the command, e.g. ls"}},
            "required": ["cmd"],
        },
    },
}
"""The OpenAI tool schema of the one tool of the terminal agent (short names: the tiny model writes
them character by character)."""

_REQUIRED = ("instruction", "test")
_OPTIONAL = ("setup", "solution")


def is_task_row(obj: Mapping[str, Any]) -> bool:
    """A row with an `instruction` is a shell task (pure)."""
    return "instruction" in obj


def task_row(obj: Mapping[str, Any], where: str) -> Row:
    """A shell-task row -> Row; ValueError names `where` and the field to fix."""
    for key in _REQUIRED:
        if not isinstance(obj.get(key), str) or not obj[key].strip():
            raise ValueError(
                f'{where}: a shell task needs "{key}" as a non-empty string (fields: "instruction", '
                f'"test", optional "setup" and "solution"); this row has {sorted(obj)}'
            )
    for key in _OPTIONAL:
        if obj.get(key) is not None and not isinstance(obj[key], str):
            raise ValueError(
                f'{where}: "{key}" must be a string (a shell script), got {type(obj[key]).__name__}'
            )
    solution = obj.get("solution") or ""
    meta = {k: v for k, v in obj.items() if k not in ("instruction", "solution")}
    meta.setdefault("setup", None)
    if solution:
        meta["reference_reply"] = reference_reply(solution)
        meta["reference_tools"] = [SH_TOOL]  # the SFT prompt renders the tools as the session server does
    return Row(({"role": "user", "content": obj["instruction"]},), solution, meta)


def reference_reply(command: str) -> dict[str, Any]:
    """The assistant message that runs `command` with the `sh` tool (what the SFT warm start imitates)."""
    args = json.dumps({"cmd": command}, separators=(",", ":"))
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "sh", "arguments": args}}],
    }


def reward(sample: Any, response: str) -> float:
    """RewardFn: 1.0 when the task's test script exited 0 after the episode, else 0.0."""
    summary = sample.metadata.get(SANDBOX_KEY)
    if not isinstance(summary, Mapping):
        return 0.0
    return 1.0 if summary.get("test_exit") == 0 else 0.0
