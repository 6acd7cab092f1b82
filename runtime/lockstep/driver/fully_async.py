"""The fully-async RL loop: rollout and training decoupled, joined by a bounded buffer (§5).

Why it exists: in the sync loop the engines wait for the optimizer and the trainer waits for the
slowest trajectory of each batch. Here a background worker (lockstep.rollout.async_worker) keeps a
fixed number of trajectories in flight while the trainer trains on complete groups from the buffer
(lockstep.rollout.buffer); at each update interval the engines' weights are updated with in-flight
requests retracted, the staleness of every consumed group is measured, and evaluation runs in the
background. Colocate and pause mode abort are refused at apply (lockstep.api.rules; §10).
`AsyncLoop` is written against small hooks (`LoopHooks`) so it is testable on its own; `run_fully_async(c)` builds them from
the Components the sync loop uses. docs/fully-async.md explains the loop and its metrics.

Who calls it: lockstep.driver.loop.run for schedule mode "fully-async", tests, bench/async_longtail.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tqdm import tqdm

from lockstep.config.driver import AsyncSettings
from lockstep.driver.batch_checks import BatchWatch, record_data
from lockstep.driver.opd import opd_metrics
from lockstep.driver.preemption import Preempted, Preemption, announce_state, until_preempted
from lockstep.driver.steps import EvalOutcome, evaluate, start
from lockstep.observability.plot import plot_metrics
from lockstep.rollout.async_worker import AsyncRolloutWorker, GenerateSample, Prompt
from lockstep.rollout.buffer import BufferClosed, BufferCounters, GroupBuffer, GroupFilter, load_group_filter
from lockstep.rollout.staleness import StalenessStats
from lockstep.trainer.state import DriverState
from lockstep.types import Group

if TYPE_CHECKING:
    from lockstep.driver.components import Components

log = logging.getLogger(__name__)

Clock = Callable[[], float]
"""Monotonic seconds; injected so tests and replays control time."""

FULLY_ASYNC_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("queue size / in flight", ("queue_size", "queue_capacity", "in_flight")),
    (
        "staleness (versions)",
        (
            "staleness_s_old_mean",
            "staleness_s_old_max",
            "staleness_s_post_mean",
            "staleness_delta_gen_mean",
            "staleness_token_weighted_mean",
        ),
    ),
    ("dropped groups (cumulative)", ("stale_groups_filtered", "aborted_groups_filtered", "filtered_groups")),
    ("version coverage / mixed", ("weight_version_sample_coverage", "mixed_version_ratio")),
    ("eval latency (s)", ("eval_eval_latency_s",)),
)
"""Extra panels of the end-of-run plot (observability.plot's extra_panels)."""


@dataclass(slots=True)
class EvalResult:
    """One evaluation, attributed to the step whose weights it evaluated."""

    step: int
    """Steps done when the engines were updated to the evaluated weights (the sync loop's eval step numbering)."""
    version: int
    """The weight version evaluated."""
    metrics: dict[str, float]
    """Scores from the evaluate hook."""
    latency_s: float
    """Seconds from launch (right after the weight update) to the score."""
    mixed_versions: bool
    """True when the engines reported a version other than `version` on evaluation tokens (the score
    mixes checkpoints; possible only when evaluation does not pin the version)."""


class LoopHooks(Protocol):
    """What the loop asks of the rest of the system; `run_fully_async` builds it from the components."""

    def train(self, groups: list[Group], step: int) -> dict[str, float]:
        """One optimizer step on complete groups (blocking; runs in a worker thread)."""
        ...

    async def update_weights(self, version: int) -> dict[str, float]:
        """Pause the engines with mode retract, update their weights to `version`, continue."""
        ...

    async def evaluate(self, version: int) -> EvalOutcome:
        """Score the weights of `version` (on the engines or elsewhere); runs in the background."""
        ...

    def save(self, state: DriverState) -> None:
        """Write a resumable checkpoint carrying `state` (blocking; runs in a worker thread)."""
        ...

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        """Record metrics ("train" or "eval") of `step`; eval scores may arrive steps late."""
        ...


HIST_CAP = 16
"""Histogram values at or above this many versions share one bucket `ge16`, so a long run does not grow
an unbounded set of metric names (and Prometheus gauges)."""


def staleness_metrics(stats: StalenessStats) -> dict[str, float]:
    """A window's staleness as flat metrics: summary plus histograms `staleness_<m>_hist_<value>` -> groups."""
    out = stats.summary()

    def add(name: str, value: float, n: int) -> None:
        label = f"{value:g}" if value < HIST_CAP else f"ge{HIST_CAP}"
        key = f"staleness_{name}_hist_{label}"
        out[key] = out.get(key, 0.0) + n

    for name, hist in (("s_old", stats.s_old), ("s_post", stats.s_post), ("delta_gen", stats.delta_gen)):
        for k, n in hist.items():
            add(name, k, n)
    for fk, n in stats.token_weighted.items():
        add("token_weighted", fk, n)
    return out


@dataclass
class AsyncLoop:
    """The fully-async loop over injected hooks. `await loop.run()` returns the state at the end."""

    settings: AsyncSettings
    """Knobs from the manifest."""
    hooks: LoopHooks
    """Train, update weights, evaluate, save and log."""
    generate: GenerateSample
    """Generates and scores one trajectory on the engines."""
    prompts: Iterator[Prompt]
    """Prompt source, already positioned after `state.prompts_consumed` prompts."""
    state: DriverState = field(default_factory=DriverState)
    """Where to start (a fresh run or a restored checkpoint); updated in place."""
    filters: tuple[GroupFilter, ...] = ()
    """User group filters applied at put."""
    clock: Clock = time.monotonic
    """Monotonic clock for waits, latencies and throughput."""
    should_stop: Callable[[], bool] = lambda: False
    """Polled after every step (Ctrl-C): the loop then saves and returns early."""
    on_step: Callable[[int, dict[str, float]], Awaitable[None]] | None = None
    """Optional async callback after each step (tests, bench)."""
    trainer_executor: Executor | None = None
    """Where blocking trainer calls (train, save) run; None: the event loop's default thread pool. One
    dedicated thread keeps the trainer's thread-local state (CUDA device, RNG streams) in one place."""
    run_stats: StalenessStats = field(default_factory=StalenessStats)
    """Staleness over the whole run (every consumed group)."""
    evals: list[EvalResult] = field(default_factory=list)
    """Finished evaluations, in completion order."""
    trained_samples: int = 0
    """Samples trained on by this run (not counting a resumed run's earlier steps)."""
    preemption: Preemption | None = None
    """SIGTERM's state: the wait for a batch is abandoned at once (its groups stay pending) and the
    loop saves and returns (lockstep.driver.preemption)."""
    pending: dict[int, int] = field(default_factory=dict)
    """Group index -> data position of every group drawn but not yet trained or dropped (buffered or in
    flight); saved with each checkpoint (DriverState.pending_groups) so a resumed run generates them
    again instead of skipping them."""
    announce: Callable[[DriverState], None] | None = None
    """Called on the event loop before each train with the state once that step is done (its update
    included, when due): what a trainer group checkpoints if SIGTERM comes before the next save
    (lockstep.driver.preemption.announce_state)."""
    _eval_tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _saved_at: int = -1
    _worker: AsyncRolloutWorker | None = None

    def _counting_prompts(self) -> Iterator[Prompt]:
        for p in self.prompts:
            if p.group_index is None:  # a fresh draw moves the data position; a redrawn group does not
                self.state.prompts_consumed = (
                    p.position + 1 if p.position >= 0 else self.state.prompts_consumed + 1
                )
            yield p

    def _submitted(self, group_index: int, prompt: Prompt) -> None:
        self.pending[group_index] = prompt.position

    def _state_after(self, groups: list[Group], buffer: GroupBuffer) -> DriverState:
        """The state once the step training `groups` is done (its update included, when due), as the
        loop would save it then (announced to a trainer group; on the event loop, like every change of
        the buffer, so the pending groups and the counts are of one instant)."""
        s = self.settings.schedule
        after = self._snapshot(buffer)
        after.step = self.state.step + 1
        after.version = self.state.version + (after.step % s.update_interval == 0 or after.step == s.steps)
        trained = {g.index for g in groups}
        after.pending_groups = [[gi, p] for gi, p in after.pending_groups if gi not in trained]
        return after

    def _snapshot(self, buffer: GroupBuffer) -> DriverState:
        """The state to save now: the loop's position with the groups still pending (a dropped group is
        decided: no longer pending, and counted)."""
        for gi in buffer.take_dropped():
            self.pending.pop(gi, None)
        snapshot = DriverState(**self.state.as_dict())
        if self._worker is not None:
            # The worker's next index, not the one of the last step's end: groups submitted since then are
            # pending under indices from there on, and a resume must not hand them out again.
            snapshot.next_group_index = self._worker.next_group_index
        snapshot.pending_groups = [[gi, pos] for gi, pos in sorted(self.pending.items()) if pos >= 0]
        snapshot.group_counts = buffer.counters.run_counts()  # the same instant as pending_groups
        return snapshot

    async def run(self) -> DriverState:
        """Start the worker, run steps until the schedule's steps (or should_stop), stop everything, save."""
        s = self.settings.schedule
        buffer = GroupBuffer(
            capacity=self.settings.capacity,
            max_staleness=self.settings.max_staleness,
            filters=self.filters,
            version=self.state.version,  # v_c starts at the resumed version (the engines hold it)
            counters=BufferCounters.resumed(self.state.group_counts),
        )
        worker = AsyncRolloutWorker(
            self.generate,
            self._counting_prompts(),
            buffer,
            samples_per_prompt=s.samples_per_prompt,
            max_in_flight=self.settings.max_in_flight,
            sample_timeout_s=self.settings.sample_timeout_s,
            first_group_index=self.state.next_group_index,
            on_submit=self._submitted,
        )
        self._worker = worker
        worker.start()
        t_start = self.clock()
        if self.state.step > 0:
            self._saved_at = self.state.step  # resumed from the checkpoint of this step
        try:
            while self.state.step < s.steps and not self.should_stop():
                try:
                    await self._one_step(buffer, worker, t_start)
                except Preempted:
                    log.warning(
                        "SIGTERM at step %d: checkpointing with %d groups pending",
                        self.state.step,
                        len(self.pending),
                    )
                    break
                except BufferClosed:
                    if worker.failure is not None:
                        # The original error (e.g. EngineUnreachable) keeps its type: `lockstep run` maps it.
                        log.error(
                            "rollout stopped at step %d; the last checkpoint is intact", self.state.step
                        )
                        raise worker.failure from None
                    log.warning("prompt source exhausted after %d steps; ending the run", self.state.step)
                    break
        finally:
            await worker.stop()
            await buffer.close()
            if self._eval_tasks:
                await asyncio.gather(*self._eval_tasks, return_exceptions=True)
        if self._saved_at != self.state.step:
            snapshot = self._snapshot(buffer)

            def save() -> None:
                if self.preemption is not None:
                    self.preemption.timed_save(lambda: self.hooks.save(snapshot))
                else:
                    self.hooks.save(snapshot)

            await asyncio.get_running_loop().run_in_executor(self.trainer_executor, save)
        return self.state

    async def _one_step(self, buffer: GroupBuffer, worker: AsyncRolloutWorker, t_start: float) -> None:
        s, st = self.settings.schedule, self.state
        t0 = self.clock()
        consumed = await until_preempted(buffer.get_batch(s.batch_groups), self.preemption)
        t1 = self.clock()
        groups = [c.group for c in consumed]
        if self.announce is not None:
            self.announce(self._state_after(groups, buffer))
        loop = asyncio.get_running_loop()
        metrics = dict(await loop.run_in_executor(self.trainer_executor, self.hooks.train, groups, st.step))
        t2 = self.clock()
        st.step += 1
        for g in groups:  # trained: never generated again
            self.pending.pop(g.index, None)
        self.trained_samples += sum(len(g.samples) for g in groups)
        metrics.update({"wait_data_s": t1 - t0, "train_wall_s": t2 - t1})
        if st.step % s.update_interval == 0 or st.step == s.steps:
            if self.settings.eval_pins_version and self._eval_tasks:
                await asyncio.gather(*self._eval_tasks, return_exceptions=True)
            try:
                metrics.update(await self.hooks.update_weights(st.version + 1))
            except Exception:  # the step trained (a trainer group may have checkpointed it): log it
                self.hooks.log("train", st.step, metrics)
                raise
            st.version += 1
            await buffer.set_version(st.version)
            metrics["update_weights_wall_s"] = self.clock() - t2
        # Groups submitted from here on carry indices >= next_group_index; a resume never reuses one.
        st.next_group_index = worker.next_group_index
        window = buffer.take_window()
        self.run_stats.merge(window)
        elapsed = max(self.clock() - t_start, 1e-9)
        metrics.update(staleness_metrics(window))
        metrics.update(buffer.metrics())
        metrics.update(worker.metrics())
        metrics.update(
            {
                "weight_version": float(st.version),
                "rollout_samples_per_s": worker.counters.finished_samples / elapsed,
                "trained_samples_per_s": self.trained_samples / elapsed,
            }
        )
        if self.settings.max_staleness is not None:  # the bound, beside the measure (the staleness alert)
            metrics["max_weight_staleness"] = float(self.settings.max_staleness)
        if s.eval_interval and (st.step % s.eval_interval == 0 or st.step == s.steps):
            self._launch_eval(st.step, st.version)
        if s.save_interval and st.step % s.save_interval == 0:
            await loop.run_in_executor(self.trainer_executor, self.hooks.save, self._snapshot(buffer))
            self._saved_at = st.step
        self.hooks.log("train", st.step, metrics)
        if self.on_step is not None:
            await self.on_step(st.step, metrics)

    def _launch_eval(self, step: int, version: int) -> None:
        """Evaluate `version` in the background; the score is logged on `step` whenever it returns."""
        t0 = self.clock()

        async def evaluate() -> None:
            try:
                outcome = await self.hooks.evaluate(version)
            except Exception as err:  # an eval failure must not stop training; it is logged on its step
                log.warning("evaluation of step %d (version %d) failed: %r", step, version, err)
                self.hooks.log("eval", step, {"eval_failed": 1.0, "weight_version": float(version)})
                return
            latency = self.clock() - t0
            mixed = bool(outcome.versions_seen - {version})
            self.evals.append(EvalResult(step, version, outcome.metrics, latency, mixed))
            scores = dict(outcome.metrics)
            scores.update(
                {"weight_version": float(version), "eval_latency_s": latency, "mixed_versions": float(mixed)}
            )
            self.hooks.log("eval", step, scores)

        task = asyncio.create_task(evaluate(), name=f"eval-step-{step}")
        self._eval_tasks.add(task)
        task.add_done_callback(self._eval_tasks.discard)


# ------------------------------------------------------------------------------- the real components


def group_filters(path: str | None) -> tuple[GroupFilter, ...]:
    """The user group filter at `path` (spec.agent.groupFilterFunction), imported now so a bad path
    fails at start."""
    if not path:
        return ()
    try:
        return (load_group_filter(path),)
    except ValueError as e:
        raise ValueError(f"spec.agent.groupFilterFunction: {e}") from e


class ComponentHooks:
    """LoopHooks over the sync driver's Components: the same train step, weight update, checkpoint and metrics."""

    def __init__(self, c: Components, pause_mode: str, executor: Executor) -> None:
        self.c = c
        """The run's components."""
        self.pause_mode = pause_mode
        """spec.weightSync.pauseMode (retract by default; abort is refused earlier)."""
        self.executor = executor
        """The trainer thread (weight export runs there, like training)."""
        self.watch = BatchWatch(c.progress)
        """No silent success: every batch is checked before it trains (lockstep.driver.batch_checks)."""

    def train(self, groups: list[Group], step: int) -> dict[str, float]:
        # every trajectory failed or a reward the loss cannot use: stop; no trained token: Degraded
        checked = self.watch.check(step + 1, groups)
        record_data(self.c, step + 1, groups)
        return self.c.trainer.train(groups) | checked

    async def update_weights(self, version: int) -> dict[str, float]:
        """Retract in-flight requests on every engine, update the weights to `version`, continue (§5)."""
        clients = self.c.clients
        await asyncio.gather(*(cl.pause_generation(self.pause_mode) for cl in clients))
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.executor, self.c.trainer.update_weights, version)
        finally:
            await asyncio.gather(*(cl.continue_generation() for cl in clients))

    async def evaluate(self, version: int) -> EvalOutcome:
        """The sync loop's evaluation (lockstep.driver.steps.evaluate), on the engines now serving `version`."""
        return await evaluate(self.c)

    def save(self, state: DriverState) -> None:
        self.c.trainer.save(state)

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        if kind == "train":  # in place: the progress report of this step reads the same dict
            metrics.update(opd_metrics(self.c.opd))
        self.c.metrics.log(kind, step, metrics)


def task_prompts(c: Components, state: DriverState) -> Iterator[Prompt]:
    """The task's train prompts, rendered with the chat format: first the groups a resumed checkpoint
    left pending (under their own group indices), then the data from position state.prompts_consumed on."""

    def prompt(position: int, group_index: int | None = None) -> Prompt:
        item = c.task.item(position, "train")
        meta = {**c.item_metadata(item), "prompt_position": position}
        return Prompt(c.rollout.render(item.messages), meta, position=position, group_index=group_index)

    if state.pending_groups:
        log.info(
            "resuming: %d groups drawn before the checkpoint are generated again", len(state.pending_groups)
        )
    for group_index, position in state.pending_groups:
        yield prompt(position, group_index)
    position = state.prompts_consumed
    while True:
        yield prompt(position)
        position += 1


def run_fully_async(c: Components) -> DriverState:
    """Run the fully-async loop on the built components; returns the final DriverState.

    Same conventions as the sync loop: resume from checkpoints/latest, SFT warm start once, the trainer's
    weights sent to the engines before the first step, eval before training and at the eval interval,
    metrics.jsonl (kinds train/eval) and metrics.png (plus the queue and staleness panels).
    """
    pause_mode = c.config.pause_mode  # retract or in_place: abort is refused at apply
    settings = c.config.async_settings
    filters = group_filters(c.config.agent.group_filter_function)
    # resume, SFT warm start once, engines == trainer before step 1 (pre-flight when asked)
    state = start(c)
    bar = tqdm(
        initial=state.step, total=settings.schedule.steps, desc="lockstep fully-async", unit="step",
        dynamic_ncols=True,
    )  # fmt: skip

    async def progress(step: int, m: dict[str, float]) -> None:
        # The report may wait on the API server (retries): off the event loop the rollouts run on.
        await asyncio.get_running_loop().run_in_executor(None, c.progress.step, step, m)
        bar.update(1)
        bar.set_postfix(
            reward=f"{m.get('reward_mean', 0.0):.2f}",
            queue=f"{m['queue_size']:.0f}/{m['queue_capacity']:.0f}",
            s_old=f"{m['staleness_s_old_mean']:.1f}",
        )

    with bar, ThreadPoolExecutor(max_workers=1, thread_name_prefix="lockstep-trainer") as trainer:
        hooks = ComponentHooks(c, pause_mode, trainer)
        loop = AsyncLoop(
            settings,
            hooks,
            c.rollout.run_sample,
            task_prompts(c, state),
            state=state,
            pending={gi: pos for gi, pos in state.pending_groups},
            filters=filters,
            clock=c.clock,
            should_stop=c.stop.is_set,
            preemption=c.preemption,
            on_step=progress,
            trainer_executor=trainer,
            announce=lambda after: announce_state(c.trainer, after),
        )
        state = c.runner.run(loop.run())
    log.info(
        "fully-async run: %d steps, version %d, staleness %s",
        state.step,
        state.version,
        {k: round(v, 3) for k, v in loop.run_stats.summary().items()},
    )
    plot_metrics(c.metrics.path, c.run_dir / "metrics.png", extra_panels=FULLY_ASYNC_PANELS)
    return state
