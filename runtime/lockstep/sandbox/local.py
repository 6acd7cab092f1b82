"""The local sandbox: one fresh confined directory per episode on this machine (`lockstep run`).

Why it exists: the same manifest that claims sandbox pods in a cluster must run whole on one machine,
with the same interface (lockstep.sandbox.base) and the same promises that matter to training: a
command cannot change anything outside its episode's directory, cannot run past its deadline, and
cannot take more than the sandbox's resources.

What a command gets: `sh -c COMMAND` in a fresh directory (removed at release), a new session (its own
process group, killed whole at the deadline), a clean environment (PATH, HOME and TMPDIR at the
directory; nothing of the driver's, so no job key), resource limits (address space = memory, CPU time
= command timeout x cores, file size = scratch disk, open files, no core dumps) and Landlock
(lockstep.sandbox.landlock): writes only under the directory, no TCP when egress is denied, no signals
to processes outside. Commands use this machine's tools, not the sandbox image's. At release every
process still running from the episode is killed, and the directory is removed.

Who calls it: lockstep.driver.sandboxes (builds it for `lockstep run`), the terminal agent through the
SandboxProvider protocol, tests, bench/sandbox.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import resource
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from lockstep.sandbox.base import ExecResult, SandboxConfig, SandboxError
from lockstep.sandbox.executor import Executor, ExecutorGone
from lockstep.sandbox.landlock import abi_version

log = logging.getLogger(__name__)

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_OPEN_FILES = 256


def _limits(config: SandboxConfig) -> list[tuple[int, int]]:
    cpu_s = math.ceil(config.command_timeout_s * max(math.ceil(config.cpu_cores), 1)) + 1
    return [
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_FSIZE, config.disk_bytes),
        (resource.RLIMIT_NOFILE, _OPEN_FILES),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_AS, config.memory_bytes),  # last (lockstep.sandbox.executor says why)
    ]


@dataclass(slots=True)
class LocalSandbox:
    """One episode's directory and the commands run in it."""

    name: str
    """The directory's name (for logs)."""
    root: Path
    """The episode's directory: the working directory and the one writable place."""
    config: SandboxConfig
    """Limits and output size."""
    executor: Executor
    """The helper process that starts the confined commands."""

    async def exec(self, command: str, *, timeout_s: float | None = None) -> ExecResult:
        """Run `command` confined (see the module doc); its process group is killed at the deadline."""
        if not self.root.is_dir():
            raise SandboxError(f"sandbox {self.name}: its directory is gone", "ExecFailed")
        env = {"PATH": _PATH, "HOME": str(self.root), "TMPDIR": str(self.root), "LANG": "C.UTF-8",
               **self.config.env}  # fmt: skip
        req = {
            "cmd": command,
            "cwd": str(self.root),
            "env": env,
            "timeout": self.config.command_timeout_s if timeout_s is None else timeout_s,
            "limits": _limits(self.config),
            "deny_tcp": not self.config.egress,
            "output_limit": self.config.output_limit,
        }
        try:
            reply = await self.executor.run(req)
        except ExecutorGone as e:
            raise SandboxError(f"sandbox {self.name}: {e}", "SandboxLost") from e
        if "error" in reply:
            raise SandboxError(f"sandbox {self.name}: {reply['error']}", "ExecFailed")
        return ExecResult(
            int(reply["exit"]),
            str(reply["output"]),
            timed_out=bool(reply["timed_out"]),
            truncated=bool(reply["truncated"]),
            seconds=float(reply["seconds"]),
        )

    def release(self) -> None:
        """Kill what the episode left running and remove its directory."""
        _kill_inside(self.root)
        shutil.rmtree(self.root, ignore_errors=True)


def _kill_inside(root: Path) -> None:
    """Kill every process whose working directory is under `root` (one that left its group with
    setsid); a /proc scan, once per episode."""
    prefix = str(root)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if cwd == prefix or cwd.startswith(prefix + "/"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)


@dataclass(slots=True)
class LocalSandboxProvider:
    """Fresh LocalSandboxes under `base_dir`, at most `max_sandboxes` at once."""

    config: SandboxConfig
    """What every sandbox is."""
    base_dir: Path | None = None
    """Where episode directories go (a temporary directory when None)."""
    max_sandboxes: int = 64
    """Episodes holding a sandbox at once; later claims wait."""
    live: dict[str, LocalSandbox] = field(default_factory=dict)
    """Sandboxes claimed and not yet released, by key."""
    executor: Executor = field(default_factory=Executor)
    """The helper process that starts every command (one per provider)."""
    _slots: asyncio.Semaphore | None = None
    _owned_base: bool = False

    def __post_init__(self) -> None:
        if abi_version() < 1:
            raise SandboxError(
                "spec.agent.sandbox: the local sandbox confines commands with Landlock, which this kernel "
                "does not offer (Linux >= 5.13 with landlock among its LSMs: check "
                "/sys/kernel/security/lsm); run the job in a cluster or on such a machine",
                "Unavailable",
            )
        if self.base_dir is None:
            self.base_dir = Path(tempfile.mkdtemp(prefix="lockstep-sandboxes-"))
            self._owned_base = True
        self.base_dir.mkdir(parents=True, exist_ok=True)

    @contextlib.asynccontextmanager
    async def claim(self, key: str) -> AsyncIterator[LocalSandbox]:
        """A fresh directory for episode `key`, released (processes killed, removed) on exit."""
        if self._slots is None:  # made on the loop that uses it
            self._slots = asyncio.Semaphore(self.max_sandboxes)
        async with self._slots:
            assert self.base_dir is not None
            safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in key)[:64]
            root = Path(tempfile.mkdtemp(prefix=f"{safe}-", dir=self.base_dir))
            box = LocalSandbox(root.name, root, self.config, self.executor)
            self.live[key] = box
            try:
                yield box
            finally:
                self.live.pop(key, None)
                box.release()

    async def aclose(self) -> None:
        """Release every sandbox still claimed and remove the base directory if this provider made it."""
        for box in list(self.live.values()):
            box.release()
        self.live.clear()
        await self.executor.aclose()
        if self._owned_base and self.base_dir is not None:
            shutil.rmtree(self.base_dir, ignore_errors=True)
