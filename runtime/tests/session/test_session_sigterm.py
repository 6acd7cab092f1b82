"""`lockstep sessions` drains on SIGTERM: a running chat turn gets its reply, then the process exits 0.

The real session server as a subprocess in front of a real reference engine on 127.0.0.1. The
engine is paused, so the agent's turn waits inside the session server (in flight, by the server's
own gauge) until the test lets the engine go on; SIGTERM arrives in between. New requests then get
503, the running turn completes with 200, and the process exits 0. It used to die on the signal
(exit -15) and cut the turn off. The timeouts are hang guards, not speed assertions.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from lockstep.weights.broadcast import free_port
from subprocesses import until


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from lockstep.driver.engines import start_reference_engine
    from lockstep.models import resolve_checkpoint

    server = start_reference_engine(
        resolve_checkpoint("builtin:tiny", cache_dir=tmp_path_factory.mktemp("c"))
    )
    try:
        yield server.url
    finally:
        server.stop()


def _gauge(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_sigterm_drains_a_running_turn_and_exits_0(engine: str, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "lockstep", "sessions", "--engine", engine, "--family", "tiny"]
    cmd += ["--port", str(port), "--drain-timeout", "120"]
    log = tmp_path / "sessions.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    replies: list[httpx.Response] = []
    paused = False
    try:
        until(
            "the server",
            lambda: httpx.get(f"{url}/metrics", timeout=2).status_code == 200,
            proc,
            log,
            timeout_s=120,
        )
        sid = httpx.post(f"{url}/sessions", json={}, timeout=30).json()["session_id"]
        httpx.post(f"{engine}/pause_generation", json={"mode": "retract"}, timeout=30).raise_for_status()
        paused = True
        turn = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 4}
        running = threading.Thread(
            target=lambda: replies.append(
                httpx.post(f"{url}/sessions/{sid}/v1/chat/completions", json=turn, timeout=600)
            ),
            daemon=True,
        )
        running.start()
        until(
            "a turn in flight", lambda: _gauge(url, "tito_requests_in_flight") == 1, proc, log, timeout_s=120
        )
        proc.send_signal(signal.SIGTERM)
        until("draining", lambda: _gauge(url, "tito_draining") == 1, proc, log, timeout_s=120)
        refused = httpx.post(f"{url}/sessions", json={}, timeout=30)
        assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
        assert not replies and proc.poll() is None  # the turn is still waiting for the engine
        httpx.post(f"{engine}/continue_generation", json={}, timeout=30).raise_for_status()
        paused = False
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        running.join(60)
        assert replies and replies[0].status_code == 200, replies[0].text if replies else "no reply"
        assert replies[0].json()["choices"][0]["message"]["role"] == "assistant"
    finally:
        if paused:
            httpx.post(f"{engine}/continue_generation", json={}, timeout=30)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
