"""Waiting on a server started as a real subprocess (the SIGTERM drain tests).

Why it exists: each drain test polls a live server until a state shows, and must fail with the server's
own log when it dies or never gets there, rather than hang.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def until(
    what: str, check: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 240
) -> None:
    """Poll `check` until true; fail naming `what` with the log's tail if `proc` exits or time runs out
    (`timeout_s` is a hang guard, not a speed assertion)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"exited waiting for {what}: {log.read_text()[-3000:]}"
        try:
            if check():
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"no {what}: {log.read_text()[-3000:]}"
        time.sleep(0.05)
