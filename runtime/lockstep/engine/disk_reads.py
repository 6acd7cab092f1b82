"""Reading a checkpoint for /update_weights_from_disk: regular files under an allowed root, with a deadline.

Why it exists: `model_path` comes from a request. The reader used to hand every `*.safetensors` name
it found to safetensors' loader, which holds the GIL while it reads: a FIFO (or a file on a hung
network volume) blocked it forever, and with it the event loop, so `/health` and `/generate` hung too.
Any directory could be named. Here:

- `model_path` must resolve (symlinks followed) inside one of the allowed roots, when the engine was
  given any (`lockstep engine --weights-root`; the operator passes the job's shared volume);
- every `*.safetensors` file must be a regular file inside the same root, checked on the opened
  descriptor (opened non-blocking, so a FIFO swapped in after the check cannot block the open);
- the bytes are read with plain reads (the GIL is released in each read) on a thread of their own,
  outside the engine's step lock, and the whole read must end within `deadline_s`; a read that does
  not is refused (its thread is left behind: a hung volume cannot be interrupted) while generation and
  `/health` go on. The bytes are then parsed in memory.

Who calls it: lockstep.engine.server (update_weights_from_disk).
"""

from __future__ import annotations

import asyncio
import os
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

DISK_READ_TIMEOUT_S = 300.0
"""Default bound on reading one update's files (a full checkpoint of a large model on a slow volume)."""
_CHUNK = 16 << 20


class DiskRefused(ValueError):
    """The path or a file of a disk update cannot be read; the message names it and the fix."""


@dataclass(frozen=True, slots=True)
class DiskPolicy:
    """Where disk updates may come from and how long reading them may take."""

    roots: tuple[Path, ...] | None = None
    """Resolved directories `model_path` must be inside; None: any directory (the engine logs it)."""
    deadline_s: float = DISK_READ_TIMEOUT_S
    """Seconds the read of one update's files may take."""

    @classmethod
    def of(cls, roots: Sequence[str | Path] | None, deadline_s: float = DISK_READ_TIMEOUT_S) -> DiskPolicy:
        if deadline_s <= 0:
            raise ValueError(f"disk read timeout {deadline_s}: must be positive")
        resolved = None if roots is None else tuple(Path(os.path.realpath(r)) for r in roots)
        return cls(roots=resolved, deadline_s=deadline_s)


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def checkpoint_files(model_path: str, policy: DiskPolicy) -> list[Path]:
    """The `*.safetensors` files of `model_path`, resolved and checked against the policy (no file is
    opened here); raises DiskRefused naming what is wrong."""
    real = Path(os.path.realpath(model_path))
    root = None
    if policy.roots is not None:
        root = next((r for r in policy.roots if _inside(real, r)), None)
        if root is None:
            allowed = ", ".join(str(r) for r in policy.roots) or "(none)"
            raise DiskRefused(
                f"model_path {model_path!r} resolves to {str(real)!r}, outside the engine's weight roots "
                f"({allowed}); write the update under one of them (lockstep engine --weights-root)"
            )
    if not real.is_dir():
        raise DiskRefused(
            f"model_path {model_path!r} holds no *.safetensors files: it is not a directory "
            "(an HF-layout checkpoint dir)"
        )
    files = sorted(real.glob("*.safetensors"))
    if not files:
        raise DiskRefused(f"model_path {model_path!r} holds no *.safetensors files")
    checked = []
    for f in files:
        target = Path(os.path.realpath(f))
        if root is not None and not _inside(target, root):
            raise DiskRefused(
                f"{f.name} in {model_path!r} links to {str(target)!r}, outside the weight root {root}"
            )
        if not stat.S_ISREG(os.stat(target).st_mode):
            raise DiskRefused(f"{f.name} in {model_path!r} is not a regular file (a FIFO, device or socket)")
        checked.append(target)
    return checked


def _read_regular(path: Path) -> bytes:
    """A regular file's bytes; the open never blocks (O_NONBLOCK), the type is checked on the descriptor."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DiskRefused(f"{path} is not a regular file (it changed after it was checked)")
        os.set_blocking(fd, True)
        buf = bytearray(st.st_size)
        view, got = memoryview(buf), 0
        while got < st.st_size:
            n = os.readv(fd, [view[got : got + _CHUNK]])
            if n == 0:
                raise DiskRefused(f"{path} ended after {got} of {st.st_size} bytes (truncated while read)")
            got += n
        return bytes(buf)
    finally:
        os.close(fd)


def _parse(files: list[Path], blobs: list[bytes]) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load

    named: list[tuple[str, torch.Tensor]] = []
    for f, data in zip(files, blobs, strict=True):
        try:
            named.extend(load(data).items())
        except Exception as e:  # a corrupt file is the caller's error, named
            raise DiskRefused(f"{f.name}: not a readable safetensors file: {type(e).__name__}: {e}") from e
    return named


async def read_checkpoint(model_path: str, policy: DiskPolicy) -> list[tuple[str, torch.Tensor]]:
    """Check and read an update's checkpoint off the event loop within the policy's deadline;
    returns its (name, tensor) pairs (owned by the caller). Raises DiskRefused or TimeoutError."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[list[tuple[str, torch.Tensor]]] = loop.create_future()

    def run() -> None:
        try:
            files = checkpoint_files(model_path, policy)
            result: list[tuple[str, torch.Tensor]] | BaseException = _parse(
                files, [_read_regular(f) for f in files]
            )
        except BaseException as e:  # handed to the awaiting request, whatever it is
            result = e
        if not loop.is_closed():
            loop.call_soon_threadsafe(_settle, done, result)

    # A thread of its own, not the engine's worker: a read stuck in the kernel must not stop the steps.
    start = time.monotonic()
    threading.Thread(target=run, name="lockstep-disk-read", daemon=True).start()
    try:
        named = await asyncio.wait_for(asyncio.shield(done), policy.deadline_s)
    except TimeoutError:
        named = None
    # The deadline is the elapsed time, not which callback the loop runs first: a read that finished
    # after it (its answer queued beside the timer's) is refused the same way.
    if named is None or time.monotonic() - start > policy.deadline_s:
        raise TimeoutError(
            f"reading model_path {model_path!r} took longer than {policy.deadline_s:g} s (a hung volume?); "
            "the read was abandoned"
        )
    return named


def _settle(
    fut: asyncio.Future[list[tuple[str, torch.Tensor]]],
    result: list[tuple[str, torch.Tensor]] | BaseException,
) -> None:
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)
