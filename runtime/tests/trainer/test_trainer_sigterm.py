"""`lockstep trainer --serve` drains on SIGTERM: the running command finishes, then exit 0.

The real server as a subprocess (one rank, gloo on CPU) in front of a real reference engine on
127.0.0.1, alone and as a rank pod runs it (`lockstep launch`, 2 ranks). A long SFT warm start is
running when SIGTERM arrives: health turns not ready, a new command gets 503 `draining`, the running
one still gets its reply, and the process exits 0. It used to die on the signal (exit -15; under
torchrun the followers died with it and the command failed) with the command's connection cut. The
timeouts are hang guards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from lockstep.weights.broadcast import free_port
from subprocesses import until

FIXTURE = Path(__file__).parents[1] / "driver" / "fixtures" / "tiny-fast.yaml"
API = "/v2"
STEPS = int(os.environ.get("SIGTERM_TEST_STEPS", "200"))
"""SFT steps of the command that runs at SIGTERM: seconds on CPU (about 6 s with one rank, 30 s
with two on 2 cores); the drain (240 s here) and torchrun's wait (300 s) are hang guards."""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def engine(cache: Path) -> Iterator[str]:
    from lockstep.driver.engines import start_reference_engine
    from lockstep.models import resolve_checkpoint

    server = start_reference_engine(resolve_checkpoint("builtin:tiny", cache_dir=cache))
    try:
        yield server.url
    finally:
        server.stop()


TWO_RANKS = [
    "launch",
    "--nnodes",
    "1",
    "--nproc-per-node",
    "2",
    "--shutdown-timeout",
    "300",
    "-m",
    "lockstep",
]
"""A rank pod's launcher over 2 ranks: torchrun's agent passes SIGTERM on to both."""
LAUNCHERS = {"one rank": [], "lockstep launch, 2 ranks": TWO_RANKS}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_sigterm_drains_the_running_command_and_exits_0(
    engine: str, cache: Path, tmp_path: Path, launcher: str
) -> None:
    job = yaml.safe_load(FIXTURE.read_text())
    job["spec"]["algorithm"]["sftWarmStart"]["steps"] = STEPS
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(job))
    port = free_port()
    url = f"http://127.0.0.1:{port}{API}"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "MASTER_ADDR", "RANK")}
    env["OMP_NUM_THREADS"] = "1"
    if LAUNCHERS[launcher]:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, "-m", "lockstep", *LAUNCHERS[launcher], "trainer", "--config", str(manifest)]
    cmd += ["--serve"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--out", str(tmp_path / "out")]
    cmd += ["--cache-dir", str(cache), "--engine-url", engine, "--drain-timeout", "240"]
    log = tmp_path / "trainer.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    replies: list[httpx.Response] = []
    try:
        until("health", lambda: httpx.get(f"{url}/health", timeout=2).json()["ready"], proc, log)
        running = threading.Thread(
            target=lambda: replies.append(httpx.post(f"{url}/warm_start", json={}, timeout=600)), daemon=True
        )
        running.start()
        until("a running command", lambda: httpx.get(f"{url}/health", timeout=2).json()["busy"], proc, log)
        proc.send_signal(signal.SIGTERM)
        until("draining", lambda: not httpx.get(f"{url}/health", timeout=2).json()["ready"], proc, log)
        refused = httpx.post(f"{url}/load_latest", json={}, timeout=30)
        assert refused.status_code == 503 and refused.json()["kind"] == "draining", refused.text
        assert proc.wait(timeout=400) == 0, log.read_text()[-3000:]
        running.join(60)
        assert replies and replies[0].status_code == 200, replies[0].text if replies else "no reply"
        assert len(replies[0].json()["steps"]) >= 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
