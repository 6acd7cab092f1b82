"""`lockstep` as PID 1 of a container ends on SIGTERM during start-up (lockstep.cli.exit_on_sigterm_as_pid1).

Found on the real node: the kernel drops signals PID 1 has no handler for, so an engine pod deleted
while it loaded its checkpoint ignored the kubelet's SIGTERM and lived out its 600 s grace period.
Here `lockstep engine` runs as PID 1 of a fresh PID namespace (unshare, as a container runtime does)
and gets SIGTERM as soon as it has a handler, i.e. long before it serves.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _signals_caught(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigCgt:"))
    return int(line.split()[1], 16)


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare (a PID namespace)"
)
def test_sigterm_ends_lockstep_as_pid1_during_start_up(tmp_path: Path) -> None:
    env = {**os.environ, "LOCKSTEP_CACHE": str(tmp_path), "PYTHONPATH": f"{ROOT / 'runtime'}"}
    cmd = ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "lockstep", "engine"]
    cmd += ["--model", "builtin:tiny", "--port", "0"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        inner = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            kids = children.read_text().split() if children.exists() else []
            inner = int(kids[0]) if kids else 0
            if inner and _signals_caught(inner) & (1 << (signal.SIGTERM - 1)):
                break  # PID 1 handles SIGTERM now: main() ran, the engine is still importing/loading
            time.sleep(0.01)
        assert inner, "the engine never started"
        os.kill(inner, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "Running on" not in out  # it ended during start-up, not after serving
