"""run_sync: the synchronous RL loop, one step after another (§1).

Why it exists: the loop of schedule mode "sync" (the default), next to fully_async.py's; lockstep.driver.loop
picks one and owns what both share (building the components, fatal errors, SIGTERM's row). Before the
first optimizer step the trainer's loaded weights go to the engines; then per step: collect a batch of
complete groups, check it (no silent success: lockstep.driver.batch_checks), train, update the engines'
weights, save at the save interval, evaluate at the eval interval. SIGTERM (lockstep.driver.preemption)
abandons the step's rollout, puts its prompts back and checkpoints at once.

Who calls it: lockstep.driver.loop.run, bench/async_longtail.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from tqdm import tqdm

from lockstep.driver.batch_checks import BatchWatch, record_data
from lockstep.driver.components import Components
from lockstep.driver.opd import opd_metrics
from lockstep.driver.preemption import Preempted, announce_state
from lockstep.driver.steps import collect_batch, evaluate_at, start
from lockstep.observability.plot import plot_metrics
from lockstep.trainer.state import DriverState


def run_sync(c: Components) -> DriverState:
    """Run steps until the schedule's steps (or until c.stop is set); returns the final state."""
    s = c.settings.schedule
    state = start(c)
    saved_at = state.step
    watch = BatchWatch(c.progress)
    with _progress_bar(state.step, s.steps) as bar:
        while state.step < s.steps and not c.stop.is_set():
            position = (state.prompts_consumed, state.next_group_index)
            try:
                groups, rollout_metrics = collect_batch(c, state)
            except Preempted:  # SIGTERM: these prompts are drawn again after the resume
                state.prompts_consumed, state.next_group_index = position
                break
            # every trajectory failed or a reward the loss cannot use: stop; no trained token: Degraded
            checked = watch.check(state.step + 1, groups)
            record_data(c, state.step + 1, groups)
            due = (state.step + 1) % s.update_interval == 0
            announce_state(c.trainer, replace(state, step=state.step + 1, version=state.version + due))
            metrics = c.trainer.train(groups) | rollout_metrics | opd_metrics(c.opd) | checked
            state.step += 1
            if state.step % s.update_interval == 0:
                state.version += 1
                try:
                    metrics |= c.trainer.update_weights(state.version)
                except Exception:  # the step trained (a trainer group may have checkpointed it): log it
                    c.metrics.log("train", state.step, metrics)
                    raise
            if _due(s.save_interval, state.step):
                c.trainer.save(state)
                saved_at = state.step
            c.metrics.log("train", state.step, metrics)
            c.progress.step(state.step, metrics)
            if _due(s.eval_interval, state.step) or (s.eval_interval and state.step == s.steps):
                c.metrics.log("eval", state.step, evaluate_at(c, state))
            bar.update(1)
            bar.set_postfix(
                reward=f"{metrics.get('task_reward_mean', metrics['reward_mean']):.2f}",
                lp_diff=f"{metrics.get('train_rollout_logprob_abs_diff', 0):.1e}",
            )
    if saved_at != state.step or state.step == 0:
        if c.preemption is not None:
            c.preemption.timed_save(lambda: c.trainer.save(state))
        else:
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
