"""The sandbox contract: one episode's private place to run shell commands, and who hands them out.

Why it exists: an agent episode needs somewhere to run the model's commands, the task's setup and its
test script, and the same agent must run on one machine and in a cluster. Both implementations keep
this one interface: `SandboxProvider.claim()` gives a fresh `Sandbox` for one episode (an async context
manager that releases it on exit, whatever happened), `Sandbox.exec(command)` runs one shell command
in the sandbox's working directory under its deadline and returns the exit code and the output.

Failures: a command that fails or runs past its deadline is the model's business (`ExecResult` says
so: exit code, `timed_out`); a sandbox that cannot be claimed, dies or stops answering raises
`SandboxError`, and the agent aborts that one sample (never the job).

Who calls it: lockstep.rollout.terminal (the terminal agent), lockstep.driver.sandboxes (builds the
provider); implementations: lockstep.sandbox.local (`lockstep run`), lockstep.sandbox.cluster (pods
claimed through kubernetes-sigs/agent-sandbox).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Protocol

TIMEOUT_EXIT = 124
"""The exit code of a command killed at its deadline (what coreutils' `timeout` returns)."""


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the command): it could not be claimed, died, or stopped
    answering. The episode's sample is aborted; `reason` is a short CamelCase word for metrics."""

    def __init__(self, message: str, reason: str = "SandboxFailed") -> None:
        super().__init__(message)
        self.reason = reason
        """Why, as one word: ClaimFailed, ClaimTimeout, SandboxLost, ExecFailed, SandboxFailed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxConfig:
    """What every sandbox of a run is (built once from spec.agent.sandbox; lockstep.driver.sandboxes)."""

    image: str
    """The environment's image (a cluster's sandbox pods run it; the local sandbox ignores it)."""
    working_dir: str = "/workspace"
    """Where commands start, and the one writable place."""
    command_timeout_s: float = 60.0
    """Wall-clock limit of one command."""
    output_limit: int = 4096
    """Most bytes of output an ExecResult carries (the rest is cut with a note)."""
    cpu_cores: float = 1.0
    """CPU of one sandbox, in cores."""
    memory_bytes: int = 1 << 30
    """Memory of one sandbox."""
    disk_bytes: int = 1 << 30
    """Scratch disk of one sandbox (locally: the largest file a command may write)."""
    egress: bool = False
    """Whether connections may leave the sandbox."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment of every command."""


@dataclass(frozen=True, slots=True)
class ExecResult:
    """What one command did."""

    exit_code: int
    """The shell's exit status (TIMEOUT_EXIT when killed at its deadline; 128+N when killed by
    signal N)."""
    output: str
    """stdout and stderr interleaved as written, cut to the output limit (decoded as UTF-8, invalid
    bytes replaced)."""
    timed_out: bool = False
    """Killed at its deadline."""
    truncated: bool = False
    """Output was longer than the limit."""
    seconds: float = 0.0
    """Wall-clock time of the command, as the caller saw it."""


class Sandbox(Protocol):
    """One episode's sandbox (see the module doc)."""

    name: str
    """A name for logs and metrics (a directory locally, a Sandbox object's name in a cluster)."""

    async def exec(self, command: str, *, timeout_s: float | None = None) -> ExecResult:
        """Run `command` with `sh -c` in the working directory; `timeout_s` overrides the config's
        command timeout. Raises SandboxError when the sandbox (not the command) failed."""
        ...


class SandboxProvider(Protocol):
    """Hands out one fresh sandbox per episode."""

    config: SandboxConfig
    """What the sandboxes are."""

    def claim(self, key: str) -> AbstractAsyncContextManager[Sandbox]:
        """A fresh sandbox for the episode `key` (unique per episode, used in names and labels),
        released when the context exits. Raises SandboxError when none can be had."""
        ...

    async def aclose(self) -> None:
        """Release whatever the provider still holds (every claim it made)."""
        ...


def cut_output(data: bytes, limit: int) -> tuple[str, bool]:
    """The first `limit` bytes of `data` as text, and whether it was cut (pure)."""
    if len(data) <= limit:
        return data.decode("utf-8", errors="replace"), False
    return data[:limit].decode("utf-8", errors="replace"), True


def parse_quantity(text: str) -> float:
    """A Kubernetes quantity (`500m`, `2`, `256Mi`, `1G`) as a number (pure); ValueError otherwise."""
    units = {
        "m": 1e-3,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
    }
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * units[suffix]
    return float(text)
