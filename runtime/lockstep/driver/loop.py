"""The synchronous RL loop on one screen (seed §1).

Why it exists: this is the product's main job. Before the first optimizer step the trainer's loaded
weights go to the engines (so rollout starts from weights that went through the trainer's own
export path); then per step: collect a batch of complete groups, train, update the engines' weights, save at
the save interval, evaluate at the eval interval. Ctrl-C once finishes the current step, saves and
returns (resumable with --resume); Ctrl-C twice abandons the step (the last checkpoint stays intact).

Who calls it: lockstep.driver.run for schedule mode "sync".
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from tqdm import tqdm

from lockstep.driver.components import Components
from lockstep.driver.steps import collect_batch, evaluate
from lockstep.observability.plot import plot_metrics
from lockstep.trainer.protocol import NonFiniteLoss, PreflightFailed
from lockstep.trainer.state import DriverState

log = logging.getLogger(__name__)


def _due(interval: int | None, step: int) -> bool:
    return interval is not None and step % interval == 0


FATAL_ERRORS: tuple[type[Exception], ...] = (PreflightFailed, NonFiniteLoss, ValueError)
"""Errors a restart of the driver cannot fix: reported as the job's error. Others (an unreachable
engine, a crash) are not: the driver pod restarts OnFailure and resumes from its checkpoint."""


def run_reported(c: Components, body: Callable[[], DriverState]) -> DriverState:
    """Run a loop `body` and report its end on the progress channel: done, or a fatal error."""
    try:
        state = body()
    except FATAL_ERRORS as e:
        c.progress.failed(e, c.run_dir)
        raise
    if state.step >= c.settings.steps:
        c.progress.finished()
    return state


def run_sync(c: Components) -> DriverState:
    """Run steps until settings.steps (or until c.stop is set); returns the final state."""
    return run_reported(c, lambda: _run_sync(c))


def start(c: Components, eval_interval: int | None) -> DriverState:
    """Before step 1 (both loops): resume, the SFT warm start once, then the first update."""
    state = c.trainer.load_latest() if c.resume is not False else None
    if state is None and c.resume:
        raise FileNotFoundError(f"--resume: no checkpoint in {c.trainer.where()}; run without --resume")
    state = state or DriverState()
    if not state.sft_done and c.settings.trainer.sft_steps > 0:
        if eval_interval:
            c.metrics.log("eval_init", 0, evaluate_at(c, state))  # reward before any training
        for k, m in enumerate(c.trainer.warm_start()):
            c.metrics.log("sft", k + 1, m)
    state.sft_done = True
    # Engines == trainer before step 1: the trainer's loaded weights go out through its own export path.
    updated = c.trainer.first_update(state.version)
    c.metrics.log("update_weights", state.step, updated)
    c.progress.init(updated, c.run_dir, state.step)
    if eval_interval and state.step == 0:
        c.metrics.log("eval", 0, evaluate_at(c, state))
    return state


def _run_sync(c: Components) -> DriverState:
    s = c.settings
    state = start(c, s.eval_interval)
    saved_at = state.step
    with _progress(state.step, s.steps) as bar:
        while state.step < s.steps and not c.stop.is_set():
            groups = collect_batch(c, state)
            metrics = c.trainer.train(groups)
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


def evaluate_at(c: Components, state: DriverState) -> dict[str, float]:
    """Evaluate and tag the metrics with the version evaluated."""
    return {**evaluate(c), "weight_version": float(state.version)}


class _progress:
    """A tqdm bar on stderr (a no-op object when tqdm is missing)."""

    def __init__(self, initial: int, total: int) -> None:
        self.bar = tqdm(initial=initial, total=total, desc="lockstep", unit="step", dynamic_ncols=True)

    def __enter__(self) -> Any:
        return self.bar

    def __exit__(self, *exc: object) -> None:
        self.bar.close()


def install_sigint(stop: threading.Event) -> None:
    """First Ctrl-C: finish the step, save, exit; second: abandon the step (KeyboardInterrupt)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        log.warning("Ctrl-C: finishing the current step, then saving a checkpoint (Ctrl-C again to abandon)")
        stop.set()

    signal.signal(signal.SIGINT, handler)
