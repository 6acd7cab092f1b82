"""The job's environment: the per-episode sandbox an agent runs its commands in (spec.agent.sandbox).

Why it exists: agentic RL (§3, §9) runs every episode in its own sandbox built from the task's
image: the model proposes shell commands, the sandbox runs them, the task's own test script gives the
reward, and the sandbox goes away. This section declares that environment once, for both places a job
runs: in a cluster every episode claims a sandbox pod from a warm pool (kubernetes-sigs/agent-sandbox,
docs/sandbox.md), and under `lockstep run` a local sandbox with the same interface runs the commands
in a fresh confined directory. The episode's turn and time limits are spec.agent.maxTurns and
spec.agent.timeoutSeconds; the tasks (instruction, optional setup script, test script) come from
spec.data (lockstep.tasks.data reads them).

Who uses it: lockstep.api.data (AgentSpec.sandbox), the driver (it builds the sandbox provider), the
operator (it renders the SandboxTemplate and SandboxWarmPool of a job).
"""

from __future__ import annotations

import enum
from typing import Final

from pydantic import Field

from lockstep.api.common import EMPTY_DEFAULT, ApiModel

QUANTITY_PATTERN: Final = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$"
"""A Kubernetes resource quantity in the forms a sandbox needs: `500m`, `1`, `2.5`, `256Mi`, `1Gi`."""

DEFAULT_MAX_TURNS: Final = 30
"""Turns of an episode when spec.agent.maxTurns is unset (§9: 30 turns or one hour)."""
DEFAULT_EPISODE_SECONDS: Final = 3600
"""Wall-clock limit of an episode when spec.agent.timeoutSeconds is unset (§9)."""


class Egress(enum.StrEnum):
    """What a sandbox may reach on the network."""

    DENY = "deny"
    """Nothing: no connection leaves the sandbox (the default; a task's setup brings what it needs)."""
    ALLOW = "allow"
    """Any destination (package installs, web access)."""


class SandboxResources(ApiModel):
    """What one sandbox may use (requests equal limits in the cluster)."""

    cpu: str = Field(default="1", max_length=32, pattern=QUANTITY_PATTERN)
    """CPU of one sandbox (a quantity: `500m`, `1`, `2`). Locally a command may use
    commandTimeoutSeconds x ceil(cpu) seconds of CPU time."""
    memory: str = Field(default="1Gi", max_length=32, pattern=QUANTITY_PATTERN)
    """Memory of one sandbox (`256Mi`, `4Gi`). Locally: the address-space limit of each command."""
    ephemeral_storage: str = Field(default="1Gi", max_length=32, pattern=QUANTITY_PATTERN)
    """Scratch disk of one sandbox (its working directory). Locally: the largest file a command may
    write."""


class SandboxSpec(ApiModel):
    """The sandbox every episode runs its commands in (docs/sandbox.md)."""

    image: str = Field(min_length=1, max_length=512)
    """The environment's container image (the task's own image, with its tools). In a cluster each
    sandbox pod runs it; `lockstep run` runs commands with this machine's tools instead."""
    working_dir: str = Field(default="/workspace", min_length=1, max_length=256, pattern=r"^/[^\s]*$")
    """The directory commands, setup and test scripts start in: the one place a command may write
    (an empty volume in the pod; a fresh directory per episode locally)."""
    command_timeout_seconds: int = Field(default=60, ge=1, le=86400)
    """Wall-clock limit of one command (and of the setup and test scripts); a command still running
    then is killed and the model reads that it timed out."""
    output_limit_bytes: int = Field(default=4096, ge=16, le=1048576)
    """Most bytes of a command's output (stdout and stderr together) returned to the model; the rest
    is cut with a note."""
    resources: SandboxResources = Field(default_factory=SandboxResources, json_schema_extra=EMPTY_DEFAULT)
    """CPU, memory and scratch disk of one sandbox."""
    egress: Egress = Egress.DENY
    """`deny` (default): no connection leaves a sandbox; `allow`: any."""
    max_sandboxes: int | None = Field(default=None, ge=1, le=65536)
    """Most sandboxes claimed at once; episodes beyond wait for one. Unset: the rollout concurrency
    (`sandbox_concurrency`)."""
    warm_pool: int | None = Field(default=None, ge=0, le=65536)
    """Sandboxes a cluster keeps started and unclaimed ahead of episodes, so a claim adopts a running
    pod instead of starting one. Unset: maxSandboxes."""


def sandbox_concurrency(
    *, sandbox: SandboxSpec, max_in_flight: int, samples_per_step: int, fully_async: bool
) -> int:
    """Sandboxes claimed at once, defined once (pure): sandbox.maxSandboxes, else the rollout
    concurrency: rollout.maxInFlight for fully-async, else one step's episodes
    (batchSize x samplesPerPrompt) capped by maxInFlight."""
    if sandbox.max_sandboxes is not None:
        return sandbox.max_sandboxes
    return max_in_flight if fully_async else max(1, min(max_in_flight, samples_per_step))


def warm_pool_size(sandbox: SandboxSpec, concurrency: int) -> int:
    """Sandboxes kept warm (pure): sandbox.warmPool, else the concurrency."""
    return sandbox.warm_pool if sandbox.warm_pool is not None else concurrency
