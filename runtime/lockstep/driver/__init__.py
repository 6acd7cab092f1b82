"""The driver process: the RL loop of one job, its components, rollout, progress and the remote trainer.

Why it exists: `lockstep run` (one machine) and the driver pod (cluster) both call `run(job, ...)`
(loop.py: read it first). The policy lives behind the Trainer protocol of lockstep.trainer, in this
process or on a trainer group's ranks (remote.py). `Preemption` is SIGTERM's state, which the CLI
installs and hands to `run` (preemption.py).

Who calls it: lockstep.cli.run, lockstep.cli.driver, tests, bench.
"""

from __future__ import annotations

from lockstep.driver.loop import run
from lockstep.driver.preemption import Preemption

__all__ = ["Preemption", "run"]
