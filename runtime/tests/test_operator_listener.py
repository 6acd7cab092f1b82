"""The operator's /metrics listens on the pod IP (loopback outside a pod), never on all interfaces.

The real `python -m lockstep_operator` as a subprocess (no cluster: its startup handler retries,
the metrics server is up regardless); its sockets are read from /proc. prometheus_client's default
address is 0.0.0.0.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from listeners import listening, on_all_interfaces


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_operator_metrics_bind_loopback_outside_a_pod(tmp_path: Path) -> None:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "POD_IP"}
    env.update(LOCKSTEP_OPERATOR_METRICS_PORT=str(port), KUBECONFIG=str(tmp_path / "none"))
    log = tmp_path / "operator.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lockstep_operator"], env=env, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 60  # a hang guard
        while not any(p == port for _, p in listening(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        assert ("127.0.0.1", port) in listening(proc.pid)
        assert on_all_interfaces(proc.pid) == set(), listening(proc.pid)
    finally:
        proc.kill()
        proc.wait()
