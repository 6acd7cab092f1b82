"""A reference engine in its own process (`python -m lockstep engine`), for tests that need two processes.

CUDA IPC handles cannot be opened by the process that created them, and NCCL needs one process per
rank, so the GPU tests and the benchmarks run the engine as a child process on 127.0.0.1.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import lockstep


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineProcess:
    """`lockstep engine` as a child process; `url` answers /health once started."""

    def __init__(
        self,
        model_dir: Path,
        *,
        device: str = "cpu",
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        runtime_dir = str(Path(lockstep.__file__).resolve().parent.parent)
        child_env = {**os.environ, **(env or {})}
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (runtime_dir, child_env.get("PYTHONPATH", "")) if p
        )
        cmd = [sys.executable, "-m", "lockstep", "engine", "--model", str(model_dir), "--device", device]
        cmd += ["--port", str(self.port), "--allow-tensor-updates", *(extra or [])]
        self.proc = subprocess.Popen(cmd, env=child_env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode} before answering /health")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError("engine did not answer /health within 300 s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
