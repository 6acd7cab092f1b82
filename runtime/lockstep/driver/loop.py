"""The RL loop on one screen (§1): start here to read Lockstep.

Why it exists: this is the product's main job. `run` builds the components of a job (components.py)
and runs its loop: `run_sync` (sync.py), or the fully-async loop (fully_async.py) for schedule mode
"fully-async". Before the first optimizer step the trainer's loaded weights go to the engines (so
rollout starts from weights that went through the trainer's own export path); then per step: collect
a batch of complete groups, train, update the engines' weights, save at the save interval, evaluate at
the eval interval. The policy is behind the Trainer protocol (lockstep.trainer): in this process or a
trainer group's ranks. Ctrl-C once finishes the current step, saves and returns (resumable with
--resume); Ctrl-C twice abandons the step (the last checkpoint stays intact). SIGTERM checkpoints at
once (lockstep.driver.preemption); its time to the durable checkpoint is logged here.

Who calls it: lockstep.cli.run and lockstep.cli.driver (through lockstep.driver.run), tests, bench.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from lockstep.api import RLJob
from lockstep.config.driver import run_config
from lockstep.driver.components import Components, build_components
from lockstep.driver.fully_async import run_fully_async
from lockstep.driver.preemption import Preemption
from lockstep.driver.settings import RunOptions
from lockstep.driver.sft import run_sft
from lockstep.driver.sync import run_sync
from lockstep.progress import START_FAILURES, DriverProgress, ProgressReporter, reporter_from_env
from lockstep.rollout.async_worker import RolloutFailed
from lockstep.trainer.protocol import NonFiniteLoss, PreflightFailed, Trainer
from lockstep.trainer.state import DriverState

log = logging.getLogger(__name__)

FATAL_ERRORS: tuple[type[Exception], ...] = (PreflightFailed, NonFiniteLoss, RolloutFailed, ValueError)
"""Errors a restart of the driver cannot fix: reported as the job's error. Others (an unreachable
engine, a crash) are not: the driver pod restarts OnFailure and resumes from its checkpoint."""


def run(
    job: RLJob,
    run_dir: Path,
    options: RunOptions | None = None,
    *,
    stop: threading.Event | None = None,
    reporter: ProgressReporter | None = None,
    preemption: Preemption | None = None,
) -> DriverState:
    """Build the components of `job`, run its loop, release the components; the final state.

    `options` are the process's flags (RunOptions: engines, trainer group, cache, resume, --steps);
    `stop` (e.g. set by the SIGINT handler) ends the loop after the current step; `preemption`
    (SIGTERM's state, lockstep.driver.preemption) makes the loop checkpoint at once. A start that cannot succeed on a restart (START_FAILURES: a bad checkpoint,
    a missing tokenizer, an unbuilt model) is reported on the progress channel, so the job fails with
    the reason instead of the pod restarting in a loop.
    """
    reporter = reporter if reporter is not None else reporter_from_env()
    # The manifest is read here, once (lockstep.config.driver); nothing below takes the RLJob.
    options = options if options is not None else RunOptions()
    config = run_config(job, steps=options.steps, embedded_engines=not options.engine_urls)
    if config.sft:  # no engines, no rollout: the SFT loop
        try:
            return run_sft(config, run_dir, options, stop=stop, progress=DriverProgress(reporter))
        except START_FAILURES as e:
            DriverProgress(reporter).start_failed(e)
            raise
    try:
        c = build_components(config, run_dir, options, reporter=reporter)
    except START_FAILURES as e:
        DriverProgress(reporter).start_failed(e)
        raise
    if stop is not None:
        c.stop = stop
    c.preemption = preemption
    try:
        with fatal_errors_reported(c):
            state = run_fully_async(c) if config.fully_async else run_sync(c)
        log_preemption(c, state)
        if state.step >= c.settings.schedule.steps:
            c.progress.finished()
        if state.step >= config.job_steps:
            # The job is done (not just a --steps override): a remote trainer group exits 0.
            shutdown_trainer(c.trainer)
        return state
    finally:
        c.close()


def shutdown_trainer(trainer: Trainer) -> None:
    """End the trainer after the last step. A trainer group already gone is no failure: the job
    succeeded when `done` was reported, and the operator stops the group's ranks from then on (on the
    real node they were often deleted before this call). Raising here would fail a driver that has
    finished, and its pod (restartPolicy OnFailure) would start the finished run again."""
    try:
        trainer.shutdown()
    except ConnectionError as e:  # TrainerUnreachable
        log.warning("the trainer was gone before its shutdown (the job is done): %s", e)


@contextmanager
def fatal_errors_reported(c: Components) -> Iterator[None]:
    """Report a loop's fatal end on the progress channel (the job's error), then let it propagate."""
    try:
        yield
    except FATAL_ERRORS as e:
        c.progress.failed(e, c.run_dir)
        raise


def log_preemption(c: Components, state: DriverState) -> None:
    """After a SIGTERM's checkpoint: how long SIGTERM to the durable checkpoint took (metrics.jsonl
    row `preemption`, and the log)."""
    seconds = c.preemption.seconds_to_checkpoint() if c.preemption is not None else None
    if seconds is None:
        return
    save_s = c.preemption.save_s if c.preemption is not None else None
    log.warning(
        "SIGTERM -> checkpoint of step %d in %.2f s (writing it: %.2f s)", state.step, seconds, save_s or 0
    )
    row = {"sigterm_to_checkpoint_s": seconds}
    if save_s is not None:
        row["checkpoint_write_s"] = save_s
    c.metrics.log("preemption", state.step, row)


def install_sigint(stop: threading.Event) -> None:
    """First Ctrl-C: finish the step, save, exit; second: abandon the step (KeyboardInterrupt)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        log.warning("Ctrl-C: finishing the current step, then saving a checkpoint (Ctrl-C again to abandon)")
        stop.set()

    signal.signal(signal.SIGINT, handler)
