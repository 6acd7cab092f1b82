"""A trainer rank pod's launcher listens on one address, never on all interfaces.

The rank pod's real command (the operator's `trainer_command()`, its launcher part) runs with the pod's
torchrun env (the operator's `rank_env`, MASTER_ADDR on loopback here) over 2 gloo workers, each
holding the default group and a second gloo group like the trainer's control group; while they are
up, every TCP listener of the whole process tree is read from /proc. Plain torchrun hosts its
rendezvous TCPStore on `::` (docs/security.md).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from listeners import listening, on_all_interfaces
from lockstep_operator.resources.commands import trainer_command
from lockstep_operator.resources.pods import rank_env

WORKER = """
import os, sys, time
from pathlib import Path
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
control = dist.new_group(backend="gloo")
dist.barrier(group=control)
box = Path(sys.argv[1])
(box / f"ready{dist.get_rank()}").touch()
while not (box / "stop").exists():
    time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
"""


def _launcher() -> list[str]:
    """The launcher part of the rank pod's command (before `-m lockstep trainer ...`), runnable here."""
    cmd = trainer_command()
    prefix = cmd[: cmd.index("-m")]
    if prefix[0] == "lockstep":
        return [sys.executable, "-m", "lockstep", *prefix[1:]]
    return [str(Path(sys.executable).with_name(prefix[0])), *prefix[1:]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_rank_pod_launcher_binds_no_wildcard(tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, **rank_env(trainer="t", namespace="ns", rank=0, nodes=1, nproc=2)}
    env.update(MASTER_ADDR="127.0.0.1", PET_MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    env.update(MASTER_PORT=str(port), PET_MASTER_PORT=str(port))
    env.pop("POD_IP", None)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    log = (tmp_path / "launch.log").open("w")
    proc = subprocess.Popen([*_launcher(), script, tmp_path], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180  # a hang guard, not a speed assertion
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "launch.log").read_text()
            time.sleep(0.1)
        found = listening(proc.pid)
        assert ("127.0.0.1", port) in found, found  # the rendezvous store is among them
        assert on_all_interfaces(proc.pid) == set(), found
        (tmp_path / "stop").touch()
        assert proc.wait(timeout=120) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    finally:
        (tmp_path / "stop").touch()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_two_rank_pods_meet_at_rank_0s_store(tmp_path: Path) -> None:
    """Two rank pods (node ranks 0 and 1, one worker each) on loopback: node rank 1's launcher joins
    node rank 0's store as a client; the workers form one world of 2; no wildcard listener anywhere."""
    port = _free_port()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs, logs = [], []
    for node in (0, 1):
        env = {**os.environ, **rank_env(trainer="t", namespace="ns", rank=node, nodes=2, nproc=1)}
        env.update(MASTER_ADDR="127.0.0.1", PET_MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
        env.update(MASTER_PORT=str(port), PET_MASTER_PORT=str(port))
        env.pop("POD_IP", None)
        logs.append((tmp_path / f"node{node}.log").open("w"))
        procs.append(
            subprocess.Popen(
                [*_launcher(), script, tmp_path], env=env, stdout=logs[-1], stderr=subprocess.STDOUT
            )
        )
    try:
        deadline = time.monotonic() + 180  # a hang guard
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):  # global ranks 0 and 1
            for node, p in enumerate(procs):
                assert p.poll() is None and time.monotonic() < deadline, (
                    tmp_path / f"node{node}.log"
                ).read_text()
            time.sleep(0.1)
        assert ("127.0.0.1", port) in listening(procs[0].pid)
        assert all(p != port for _, p in listening(procs[1].pid))  # node rank 1 hosts no store
        assert on_all_interfaces(procs[0].pid) | on_all_interfaces(procs[1].pid) == set()
        (tmp_path / "stop").touch()
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        (tmp_path / "stop").touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
