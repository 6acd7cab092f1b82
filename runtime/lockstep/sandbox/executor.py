"""The local sandbox's executor: a small helper process that starts every confined command.

Why it exists: confining a command (Landlock and resource limits, lockstep.sandbox.landlock) needs
code to run between fork and exec. Forking the driver for that is slow: it holds torch and the
model (gigabytes mapped), and Python cannot use vfork when code runs in the child, so each command
cost ~60 ms of the driver's time, which dominated a one-machine episode. This helper is a plain Python
process with nothing but the standard library loaded; it forks in about a millisecond, and the driver
talks to it over a pipe. One executor serves every sandbox of a provider, many commands at once.

Protocol (JSON lines): the driver writes {"id", "cmd", "cwd", "env", "timeout", "limits": [[which,
value], ...], "deny_tcp", "output_limit"} to the helper's stdin; the helper answers {"id", "exit",
"output", "timed_out", "truncated", "seconds"} or {"id", "error"} on stdout, in completion order.
Each command runs as `sh -c CMD` in its own session; at its deadline, and after it ends, its whole
process group is killed.

Who calls it: lockstep.sandbox.local (Executor); `python -m lockstep.sandbox.helper` is the helper.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from lockstep.sandbox.base import TIMEOUT_EXIT, cut_output
from lockstep.sandbox.landlock import Confinement

_READ_CHUNK = 65536
_LINE_LIMIT = 64 << 20  # one request or reply line (commands and their cut output are far smaller)


# ----------------------------------------------------------------------------------- the helper side


def _child_setup(limits: list[tuple[int, int]], confinement: Confinement) -> Callable[[], None]:
    """The preexec_fn: Landlock, then the limits, the address space last (nothing may allocate after)."""
    pairs = [(which, (value, value)) for which, value in limits]

    def setup() -> None:
        confinement.apply()
        for which, pair in pairs:
            resource.setrlimit(which, pair)

    return setup


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def run_confined(req: dict[str, Any]) -> dict[str, Any]:
    """Run one request's command confined to its cwd (see the module doc); the reply."""
    import subprocess

    limit = int(req["output_limit"])
    confinement = Confinement.prepare(req["cwd"], deny_tcp=bool(req["deny_tcp"]))
    t0 = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", req["cmd"],
            cwd=req["cwd"], env=req["env"], stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            preexec_fn=_child_setup([(int(w), int(v)) for w, v in req["limits"]], confinement),
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return {"id": req["id"], "error": f"cannot start a command: {type(e).__name__}: {e}"}
    finally:
        confinement.close()
    kept = bytearray()
    stdout = proc.stdout
    assert stdout is not None

    async def drain() -> None:
        while chunk := await stdout.read(_READ_CHUNK):
            if len(kept) <= limit:
                kept.extend(chunk[: limit + 1 - len(kept)])  # one byte more tells it was cut
        await proc.wait()

    timed_out = False
    try:
        await asyncio.wait_for(drain(), float(req["timeout"]))
    except TimeoutError:
        timed_out = True
    finally:
        _kill_group(proc.pid)  # what it left running in the background goes with it
        await proc.wait()
    text, cut = cut_output(bytes(kept), limit)
    rc = proc.returncode if proc.returncode is not None else -1
    code = TIMEOUT_EXIT if timed_out else (128 - rc if rc < 0 else rc)  # killed by signal N: 128 + N
    return {"id": req["id"], "exit": code, "output": text, "timed_out": timed_out, "truncated": cut,
            "seconds": time.monotonic() - t0}  # fmt: skip


async def serve() -> None:
    """The helper's main loop (`python -m lockstep.sandbox.helper`): requests from stdin, replies to
    stdout, until stdin closes."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=_LINE_LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout.buffer
    tasks: set[asyncio.Task[None]] = set()

    async def one(req: dict[str, Any]) -> None:
        try:
            reply = await run_confined(req)
        except Exception as e:  # a bad request: answer it, keep serving the others
            reply = {"id": req.get("id"), "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()

    while line := await reader.readline():
        task = asyncio.create_task(one(json.loads(line)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    for task in list(tasks):  # stdin closed: the driver is gone or done; finish nothing new
        task.cancel()


# ----------------------------------------------------------------------------------- the driver side


class ExecutorGone(RuntimeError):
    """The helper process exited; the commands it was running are lost."""


class Executor:
    """The driver's handle on one helper process: `await run(request)` -> reply. Starts the helper on
    first use on the running event loop; a helper that died is started again for the next request."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next = 0
        self._reader: asyncio.Task[None] | None = None
        self._lock: asyncio.Lock | None = None

    async def run(self, req: dict[str, Any]) -> dict[str, Any]:
        """Send one request (its "id" is set here) and wait for its reply. Raises ExecutorGone."""
        proc = await self._started()
        self._next += 1
        req = {**req, "id": self._next}
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[self._next] = fut
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(req).encode() + b"\n")
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as e:
            self._pending.pop(req["id"], None)
            raise ExecutorGone(f"the sandbox executor is gone: {e}") from e
        return await fut

    async def _started(self) -> asyncio.subprocess.Process:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._proc is None or self._proc.returncode is not None:
                env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                       "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # fmt: skip
                self._proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "lockstep.sandbox.helper",
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
                    limit=_LINE_LIMIT,
                )  # fmt: skip
                self._reader = asyncio.create_task(self._read(self._proc))
            return self._proc

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            reply = json.loads(line)
            fut = self._pending.pop(int(reply["id"]), None)
            if fut is not None and not fut.done():
                fut.set_result(reply)
        await proc.wait()
        lost, self._pending = self._pending, {}
        for fut in lost.values():
            if not fut.done():
                fut.set_exception(ExecutorGone(f"the sandbox executor exited with {proc.returncode}"))

    async def aclose(self) -> None:
        """Stop the helper (closing its stdin ends it; killed if it lingers)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        if self._reader is not None:
            await self._reader
