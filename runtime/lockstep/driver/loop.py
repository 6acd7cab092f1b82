"""The RL loop on one screen (seed §1): start here to read Lockstep.

Why it exists: this is the product's main job. `run` builds the components of a job (components.py)
and runs its loop: `run_sync` below, or the fully-async loop (fully_async.py) for schedule mode
"fully-async". Before the first optimizer step the trainer's loaded weights go to the engines (so
rollout starts from weights that went through the trainer's own export path); then per step: collect
a batch of complete groups, train, update the engines' weights, save at the save interval, evaluate at
the eval interval. The policy is behind the Trainer protocol (lockstep.trainer): in this process or a
trainer group's ranks. Ctrl-C once finishes the current step, saves and returns (resumable with
--resume); Ctrl-C twice abandons the step (the last checkpoint stays intact).

Who calls it: lockstep.cli.run and lockstep.cli.driver (through lockstep.driver.run), tests, bench.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from tqdm import tqdm

from lockstep.api import RLJob, ScheduleMode
from lockstep.driver.components import Components, build_components
from lockstep.driver.fully_async import run_fully_async
from lockstep.driver.report import START_FAILURES, DriverProgress, ProgressReporter, reporter_from_env
from lockstep.driver.settings import Resume
from lockstep.driver.steps import collect_batch, evaluate_at, start
from lockstep.observability.plot import plot_metrics
from lockstep.trainer.protocol import NonFiniteLoss, PreflightFailed, Trainer
from lockstep.trainer.state import DriverState

log = logging.getLogger(__name__)

FATAL_ERRORS: tuple[type[Exception], ...] = (PreflightFailed, NonFiniteLoss, ValueError)
"""Errors a restart of the driver cannot fix: reported as the job's error. Others (an unreachable
engine, a crash) are not: the driver pod restarts OnFailure and resumes from its checkpoint."""


def run(
    job: RLJob,
    run_dir: Path,
    *,
    steps: int | None = None,
    resume: Resume = Resume.NEVER,
    stop: threading.Event | None = None,
    engine_urls: Sequence[str] = (),
    prometheus_port: int = 0,
    cache_dir: Path | None = None,
    engine_ready_timeout_s: float = 60.0,
    reporter: ProgressReporter | None = None,
    trainer_url: str | None = None,
    trainer_timeout_s: float = 600.0,
) -> DriverState:
    """Build the components of `job`, run its loop, release the components; the final state.

    `stop` (e.g. set by the SIGINT handler) ends the loop after the current step; the other options
    are build_components'. A start that cannot succeed on a restart (START_FAILURES: a bad checkpoint,
    a missing tokenizer, an unbuilt model) is reported on the progress channel, so the job fails with
    the reason instead of the pod restarting in a loop.
    """
    reporter = reporter if reporter is not None else reporter_from_env()
    try:
        c = build_components(
            job, run_dir, steps=steps, resume=resume, engine_urls=engine_urls, prometheus_port=prometheus_port,
            cache_dir=cache_dir, engine_ready_timeout_s=engine_ready_timeout_s, reporter=reporter,
            trainer_url=trainer_url, trainer_timeout_s=trainer_timeout_s,
        )  # fmt: skip
    except START_FAILURES as e:
        DriverProgress(reporter).start_failed(e)
        raise
    if stop is not None:
        c.stop = stop
    try:
        with fatal_errors_reported(c):
            state = run_fully_async(c) if job.spec.schedule.mode is ScheduleMode.FULLY_ASYNC else run_sync(c)
        if state.step >= c.settings.schedule.steps:
            c.progress.finished()
        if state.step >= job.spec.schedule.steps:
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


def run_sync(c: Components) -> DriverState:
    """Run steps until the schedule's steps (or until c.stop is set); returns the final state."""
    s = c.settings.schedule
    state = start(c)
    saved_at = state.step
    with _progress_bar(state.step, s.steps) as bar:
        while state.step < s.steps and not c.stop.is_set():
            groups, rollout_metrics = collect_batch(c, state)
            metrics = c.trainer.train(groups) | rollout_metrics
            state.step += 1
            if state.step % s.update_interval == 0:
                state.version += 1
                metrics |= c.trainer.update_weights(state.version)
            if _due(s.save_interval, state.step):
                c.trainer.save(state)
                saved_at = state.step
            c.metrics.log("train", state.step, metrics)
            c.progress.step(state.step, metrics)
            if _due(s.eval_interval, state.step) or (s.eval_interval and state.step == s.steps):
                c.metrics.log("eval", state.step, evaluate_at(c, state))
            bar.update(1)
            bar.set_postfix(
                reward=f"{metrics['reward_mean']:.2f}",
                lp_diff=f"{metrics.get('train_rollout_logprob_abs_diff', 0):.1e}",
            )
    if saved_at != state.step or state.step == 0:
        c.trainer.save(state)
    plot_metrics(c.metrics.path, c.run_dir / "metrics.png")
    return state


def _due(interval: int | None, step: int) -> bool:
    return interval is not None and step % interval == 0


@contextmanager
def _progress_bar(initial: int, total: int) -> Iterator[tqdm]:
    """A tqdm bar on stderr, closed at the end."""
    bar = tqdm(initial=initial, total=total, desc="lockstep", unit="step", dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


def install_sigint(stop: threading.Event) -> None:
    """First Ctrl-C: finish the step, save, exit; second: abandon the step (KeyboardInterrupt)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        log.warning("Ctrl-C: finishing the current step, then saving a checkpoint (Ctrl-C again to abandon)")
        stop.set()

    signal.signal(signal.SIGINT, handler)
