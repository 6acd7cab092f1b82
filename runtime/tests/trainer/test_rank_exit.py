"""A trainer rank exits 0 only when the job is done or its own stop was asked for.

A rank whose group stopped for another reason (a follower whose rank 0 was deleted, rank 0 drained by
a follower's SIGTERM) used to exit 0 too, so its pod ended Succeeded mid-run: a silent success the
operator did not restart, and a replacement rank 0 waited alone in the rendezvous. Now rank 0 tells
the followers why it released them and such a rank exits STOPPED_EARLY_EXIT. The rule is a table
here; the second test sends the release over a real 2-process gloo group.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from lockstep.trainer.server import STOPPED_EARLY_EXIT, rank_exit
from lockstep.weights.broadcast import free_port

CASES = [
    ("the driver's shutdown: the job is done", 1, "shutdown", False, 0),
    ("rank 0's own SIGTERM: a requested stop", 0, "sigterm", True, 0),
    ("a follower that got SIGTERM itself", 1, "sigterm", True, 0),
    ("a follower whose rank 0 was deleted", 1, "sigterm", False, STOPPED_EARLY_EXIT),
    ("rank 0 drained by a follower's SIGTERM", 0, "peer", False, STOPPED_EARLY_EXIT),
    ("a follower whose rank 0 failed", 1, "error", False, STOPPED_EARLY_EXIT),
]


@pytest.mark.parametrize(("rank", "ending", "own", "code"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rank_exit(rank: int, ending: str, own: bool, code: int) -> None:
    assert rank_exit(rank, ending, own_sigterm=own) == code


RANK = """
import sys
from types import SimpleNamespace
import torch.distributed as dist
from lockstep.trainer.server import rank_exit
from lockstep.trainer.spmd import LeaderBackend, control_group, follow

rank, port, why = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
group = control_group()
if rank == 0:
    lead = LeaderBackend(SimpleNamespace(rank=0, world_size=2), group)  # no backend call is announced
    lead.release_followers() if why == "default" else lead.release_followers(why)
    code = 0
else:
    code = rank_exit(1, follow(None, group), own_sigterm=False)
dist.destroy_process_group()
sys.exit(code)
"""


@pytest.mark.heavy
@pytest.mark.parametrize(("why", "code"), [("default", 0), ("sigterm", STOPPED_EARLY_EXIT)])
def test_a_follower_released_before_the_shutdown_exits_non_zero(tmp_path: Path, why: str, code: int) -> None:
    """Rank 0 releases the follower over a real gloo group: after the driver's shutdown (the default)
    it exits 0; after rank 0's SIGTERM drain (its pod deleted) it exits STOPPED_EARLY_EXIT."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), port, why], env=env, stderr=subprocess.PIPE)
        for r in (0, 1)
    ]
    codes = [p.wait(timeout=300) for p in procs]  # a hang guard
    errors = [p.stderr.read().decode()[-2000:] if p.stderr else "" for p in procs]
    assert codes == [0, code], errors
    if code:
        assert "stopped before the driver's shutdown (rank 0 got SIGTERM" in errors[1], errors[1]
