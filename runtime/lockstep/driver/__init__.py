"""The driver: owns the RL loop of one job and dispatches on the schedule mode.

Why it exists: `lockstep run` (one machine) and the driver pod (cluster) both call `run(job, ...)`:
it builds the components (components.py) and runs the synchronous loop (loop.py) or, for
spec.schedule.mode "fully-async", `lockstep.driver.fully_async.run_fully_async(job, components)`.
The policy is behind the `Trainer` protocol (lockstep.trainer.protocol): in this process
(lockstep.trainer.local.LocalTrainer) or the trainer group's ranks over HTTP (remote.py, served by
lockstep.trainer.server).

Who calls it: lockstep.cli.run, lockstep.cli.driver.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.driver.components import build_components
from lockstep.driver.fully_async import run_fully_async
from lockstep.driver.loop import run_sync

if TYPE_CHECKING:
    import threading

    from lockstep.api import RLJob


def run(
    job: RLJob,
    run_dir: Path,
    *,
    steps: int | None = None,
    resume: bool = False,
    stop: threading.Event | None = None,
    **build_options: Any,
) -> Any:
    """Build the components of `job` and run its loop; components are always released.

    `stop` (e.g. set by the SIGINT handler) ends the loop after the current step.
    """
    components = build_components(job, run_dir, steps=steps, resume=resume, **build_options)
    if stop is not None:
        components.stop = stop
    try:
        if str(job.spec.schedule.mode) == "fully-async":
            state = run_fully_async(job, components)
        else:
            state = run_sync(components)
        if state.step >= job.spec.schedule.steps:
            # The job is done (not just a --steps override): a remote trainer group exits 0.
            components.trainer.shutdown()
        return state
    finally:
        components.close()
