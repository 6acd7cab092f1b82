"""Sandboxes: where an agent episode runs the model's shell commands, the task's setup and its test.

Why it exists: agentic RL (§3, §9) scores an episode by the task's own test script run in the
environment the model acted in. One interface (base.py: a provider claims a fresh sandbox per
episode; a sandbox executes commands under a deadline) and two implementations: local.py for one
machine (a confined directory; landlock.py) and cluster.py for Kubernetes (sandbox pods claimed from
the job's warm pool of kubernetes-sigs/agent-sandbox, commands through the Kubernetes API).

Who calls it: lockstep.rollout.terminal (the terminal agent), lockstep.driver.sandboxes, bench/.
"""

from lockstep.sandbox.base import (
    TIMEOUT_EXIT,
    ExecResult,
    Sandbox,
    SandboxConfig,
    SandboxError,
    SandboxProvider,
)
from lockstep.sandbox.local import LocalSandbox, LocalSandboxProvider

__all__ = [
    "TIMEOUT_EXIT",
    "ExecResult",
    "LocalSandbox",
    "LocalSandboxProvider",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxProvider",
]
