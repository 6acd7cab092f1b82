"""spec.data and spec.agent: what the rollout draws (the prompts) and the user code it runs (the agent,
generate, reward and group-filter functions, the sandbox).

Why it exists: these two sections say what a job learns from, as opposed to how it learns
(algorithm, trainer); they are declared here with the forms each source and import path may take.

Who uses it: lockstep.api.rljob (RLJobSpec.data, RLJobSpec.agent), lockstep.config (the data source,
AgentSetup), the operator (the driver pod's image).
"""

from __future__ import annotations

from pydantic import Field

from lockstep.api.common import IMPORT_PATH_PATTERN, ApiModel
from lockstep.api.sandbox import SandboxSpec


class DataSpec(ApiModel):
    """Where prompts come from."""

    prompts: str = Field(min_length=1, max_length=1024)
    """Prompt source: a JSON-lines file or directory, a local Hugging Face dataset directory (`DIR`,
    `DIR:split` or `DIR:config:split`), a hub dataset id (`org/name[@rev][:config][:split]`), or
    `builtin:<task>` for a task that ships with Lockstep."""
    eval_prompts: str | None = Field(default=None, max_length=1024)
    """Held-out prompt source for evaluation (same forms)."""
    shuffle: bool = True
    """Shuffle user prompts (files, datasets) in a new seeded order every epoch; a resumed run draws
    the same prompts as an uninterrupted one. Built-in tasks draw each prompt from the seed already."""
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    """Seed of the shuffle and of sampling."""


class AgentSpec(ApiModel):
    """User code: the agent loop, the generate function and the reward, by import path."""

    image: str | None = Field(default=None, max_length=512)
    """Image with the user code (the driver's image when unset)."""
    agent_function: str | None = Field(default=None, max_length=256, pattern=IMPORT_PATH_PATTERN)
    """`module:function` running one multi-turn episode against the session server."""
    generate_function: str | None = Field(default=None, max_length=256, pattern=IMPORT_PATH_PATTERN)
    """`module:function` replacing the default single-turn generate."""
    reward_function: str | None = Field(default=None, max_length=256, pattern=IMPORT_PATH_PATTERN)
    """`module:function` scoring a sample; unset uses the task's built-in reward."""
    max_turns: int | None = Field(default=None, ge=1, le=100000)
    """End an episode after this many turns (with a sandbox, unset is 30)."""
    timeout_seconds: int | None = Field(default=None, ge=1, le=604800)
    """End an episode after this long (with a sandbox, unset is 3600: the task's test then scores it)."""
    sandbox: SandboxSpec | None = None
    """The environment every episode runs its commands in, one sandbox per episode (docs/sandbox.md).
    With it, the tasks are shell tasks (instruction, setup, test) and the agent defaults to the
    terminal agent, the reward to the task's test script."""
    group_filter_function: str | None = Field(default=None, max_length=256, pattern=IMPORT_PATH_PATTERN)
    """`module:function` taking a Group and returning True to keep it; applied when a complete group
    enters the fully-async buffer (unset keeps every group)."""
