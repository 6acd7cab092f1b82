"""The fully-async RL loop: rollout and training decoupled, joined by a bounded buffer (seed §5).

Why it exists: in the sync loop (`lockstep.driver`) the engines wait for the optimizer and the trainer
waits for the slowest trajectory of each batch. Here a background worker (lockstep.rollout.async_worker)
keeps a fixed number of trajectories in flight on the engines while the trainer trains on complete
groups taken from the buffer (lockstep.rollout.buffer). After each update interval the new weights are
pushed with in-flight requests retracted and continued under the new version, so one trajectory may span
versions; the staleness of every consumed group is measured (S_old, S_post, delta_gen, token-weighted,
coverage) and optionally bounded. Evaluation runs as a background task: each score is attributed to the
step whose weights it evaluated and its latency is recorded, so a score that arrives steps later still
lands on the right step.

Rollout and training need separate resources: colocate (trainer and engines sharing GPUs) cannot overlap
them, so it is refused at start (seed §10, fail early).

Structure: `AsyncLoop` is the loop itself, written against four small hooks (`LoopHooks`: train, publish,
evaluate, save/log) and a `GenerateSample` callable, so it is testable and benchmarkable on its own;
`run_fully_async(job, components)` builds those hooks from the sync driver's components and runs it.

Who calls it: `lockstep.driver.run(job)` when `schedule.mode == "fully-async"` (hence `lockstep run`),
tests, and bench/async_longtail.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from lockstep.rollout.async_worker import AsyncRolloutWorker, GenerateSample, Prompt
from lockstep.rollout.buffer import GroupBuffer, GroupFilter
from lockstep.rollout.staleness import StalenessStats
from lockstep.types import Group

log = logging.getLogger(__name__)

Clock = Callable[[], float]
"""Monotonic seconds; injected so tests and replays control time."""


class ColocateRefused(ValueError):
    """Fully-async was asked for with colocate: the two phases cannot overlap on shared GPUs."""


def check_schedule(mode: str, colocate: bool, pause_mode: str = "retract") -> None:
    """Fail at start when the schedule cannot keep its promise (seed §10)."""
    if mode != "fully-async":
        return
    if colocate:
        raise ColocateRefused(
            "spec.schedule: mode fully-async cannot run with colocate: true; fully-async generates while "
            "the trainer trains, which needs separate resources for engines and trainer. Set colocate: false "
            "(separate GPUs, or on one machine the engine in its own process) or use mode: sync"
        )
    if pause_mode == "abort":
        raise ValueError(
            "spec.weightSync.pauseMode: abort cannot be used with schedule.mode fully-async: every weight "
            "update would abort the in-flight trajectories and their groups would be dropped; use retract "
            "(the default: requests resume under the new weights and record per-token versions)"
        )


@dataclass(slots=True, frozen=True)
class AsyncSettings:
    """The loop's knobs, read from the RLJob's schedule and rollout sections."""

    steps: int
    """Optimizer steps to run in total (a resumed run continues up to this)."""
    batch_groups: int
    """Groups consumed per step."""
    n_samples_per_prompt: int
    """Samples per group."""
    max_in_flight: int
    """Trajectories kept generating at once (credits); >= n_samples_per_prompt."""
    max_staleness: int | None = None
    """Bound on S_old in published versions; None (default) never rejects."""
    buffer_groups: int | None = None
    """Buffer capacity in groups; None means 2 x batch_groups."""
    update_interval: int = 1
    """Publish new weights every this many steps (versions == steps only when 1)."""
    eval_interval: int | None = None
    """Launch an evaluation every this many steps (and after the last); None: never."""
    save_interval: int | None = None
    """Save a checkpoint every this many steps (and after the last); None: only via hooks' own policy."""
    sample_timeout_s: float | None = None
    """Per-trajectory limit; an over-long trajectory is aborted and its group dropped at put."""
    eval_pins_version: bool = True
    """When evaluation shares the rollout engines, the next publish waits for running evaluations so a
    score never mixes checkpoints (training continues meanwhile; only the weight update waits)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_groups", "n_samples_per_prompt", "max_in_flight", "update_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_in_flight < self.n_samples_per_prompt:
            raise ValueError(
                f"maxInFlight ({self.max_in_flight}) must be >= n_samples_per_prompt ({self.n_samples_per_prompt})"
            )

    @property
    def capacity(self) -> int:
        """The buffer capacity actually used."""
        return self.buffer_groups if self.buffer_groups is not None else 2 * self.batch_groups


@dataclass(slots=True)
class LoopState:
    """What a checkpoint must carry for the loop to resume where it stopped."""

    step: int = 0
    """Optimizer steps done."""
    version: int = 0
    """Weight version the engines hold (published)."""
    next_group_index: int = 0
    """Index of the next group the worker submits (keeps indices unique across resume)."""
    prompts_consumed: int = 0
    """Prompts drawn from the prompt source so far (the source skips these on resume)."""

    def as_dict(self) -> dict[str, int]:
        return {
            "step": self.step,
            "version": self.version,
            "next_group_index": self.next_group_index,
            "prompts_consumed": self.prompts_consumed,
        }


@dataclass(slots=True)
class EvalOutcome:
    """What the evaluate hook returns."""

    metrics: dict[str, float]
    """Scores (e.g. {"accuracy": 0.4}); logged as eval/<name>."""
    versions_seen: set[int] = field(default_factory=set)
    """Weight versions the engines reported on the evaluation's tokens; proves which weights were scored."""


@dataclass(slots=True)
class EvalResult:
    """One evaluation, attributed to the step whose weights it evaluated."""

    step: int
    """The step whose weights were evaluated (weights after this step's update)."""
    version: int
    """The weight version evaluated."""
    metrics: dict[str, float]
    """Scores from the evaluate hook."""
    latency_s: float
    """Seconds from launch (right after the publish) to the score."""
    mixed_versions: bool
    """True when the engines reported a version other than `version` on evaluation tokens (score mixes
    checkpoints; happens only when evaluation does not pin the version)."""


class LoopHooks(Protocol):
    """What the loop asks of the rest of the system; `run_fully_async` builds it from the components."""

    def train(self, groups: list[Group], step: int) -> dict[str, float]:
        """One optimizer step on complete groups (blocking; runs in a worker thread)."""
        ...

    async def publish(self, version: int) -> dict[str, float]:
        """Pause the engines with mode retract, push the trainer's weights as `version`, continue."""
        ...

    async def evaluate(self, version: int) -> EvalOutcome:
        """Score the weights of `version` (on the engines or elsewhere); runs in the background."""
        ...

    def save(self, state: LoopState) -> None:
        """Write a resumable checkpoint carrying `state` (blocking; runs in a worker thread)."""
        ...

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record metrics of `step` (JSONL, Prometheus, plot); may be called late for eval scores."""
        ...


def histogram_metrics(stats: StalenessStats) -> dict[str, float]:
    """Flatten a window's staleness histograms into metrics: staleness/<measure>_hist/<value> -> groups."""
    out: dict[str, float] = {}
    for name, hist in (("s_old", stats.s_old), ("s_post", stats.s_post), ("delta_gen", stats.delta_gen)):
        for k, n in hist.items():
            out[f"staleness/{name}_hist/{k}"] = float(n)
    for fk, n in stats.token_weighted.items():
        out[f"staleness/token_weighted_hist/{fk:g}"] = float(n)
    return out


@dataclass
class AsyncLoop:
    """The fully-async loop over injected hooks. `await loop.run()` returns the state at the end."""

    settings: AsyncSettings
    """Knobs from the manifest."""
    hooks: LoopHooks
    """Train, publish, evaluate, save and log."""
    generate: GenerateSample
    """Generates and scores one trajectory on the engines."""
    prompts: Iterator[Prompt]
    """Prompt source, already positioned after `state.prompts_consumed` prompts."""
    state: LoopState = field(default_factory=LoopState)
    """Where to start (a fresh run or a restored checkpoint)."""
    filters: tuple[GroupFilter, ...] = ()
    """User group filters applied at put."""
    clock: Clock = time.monotonic
    """Monotonic clock for waits, latencies and throughput."""
    run_stats: StalenessStats = field(default_factory=StalenessStats)
    """Staleness over the whole run (every consumed group)."""
    evals: list[EvalResult] = field(default_factory=list)
    """Finished evaluations, in completion order."""
    on_step: Callable[[int, dict[str, float]], Awaitable[None]] | None = None
    """Optional async callback after each step (tests, bench)."""
    _eval_tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def _counting_prompts(self) -> Iterator[Prompt]:
        for p in self.prompts:
            self.state.prompts_consumed += 1
            yield p

    async def run(self) -> LoopState:
        s = self.settings
        buffer = GroupBuffer(
            capacity=s.capacity,
            max_staleness=s.max_staleness,
            filters=self.filters,
            version=self.state.version,
        )
        worker = AsyncRolloutWorker(
            self.generate,
            self._counting_prompts(),
            buffer,
            n_samples_per_prompt=s.n_samples_per_prompt,
            max_in_flight=s.max_in_flight,
            sample_timeout_s=s.sample_timeout_s,
            first_group_index=self.state.next_group_index,
        )
        worker.start()
        t_start = self.clock()
        try:
            while self.state.step < s.steps:
                await self._one_step(buffer, worker, t_start)
        finally:
            await worker.stop()
            await buffer.close()
            if self._eval_tasks:
                await asyncio.gather(*self._eval_tasks, return_exceptions=True)
        return self.state

    async def _one_step(self, buffer: GroupBuffer, worker: AsyncRolloutWorker, t_start: float) -> None:
        s, st = self.settings, self.state
        t0 = self.clock()
        consumed = await buffer.get_batch(s.batch_groups)
        t1 = self.clock()
        groups = [c.group for c in consumed]
        metrics = await asyncio.to_thread(self.hooks.train, groups, st.step)
        t2 = self.clock()
        st.step += 1
        metrics["time/wait_data_s"] = t1 - t0
        metrics["time/train_s"] = t2 - t1
        if st.step % s.update_interval == 0 or st.step == s.steps:
            if s.eval_pins_version and self._eval_tasks:
                await asyncio.gather(*self._eval_tasks, return_exceptions=True)
            pub = await self.hooks.publish(st.version + 1)
            st.version += 1
            await buffer.set_version(st.version)
            metrics.update({f"weights/{k}": v for k, v in pub.items()})
            metrics["time/update_weights_s"] = self.clock() - t2
        metrics["weight_version"] = float(st.version)
        window = buffer.take_window()
        self.run_stats.merge(window)
        metrics.update(window.summary())
        metrics.update(histogram_metrics(window))
        metrics.update(buffer.metrics())
        metrics.update(worker.metrics())
        n_samples = sum(len(g.samples) for g in groups)
        metrics["rollout/samples_per_s"] = worker.counters.finished_samples / max(
            self.clock() - t_start, 1e-9
        )
        metrics["train/samples"] = float(n_samples)
        metrics["reward/mean"] = sum(sum(g.rewards) for g in groups) / max(n_samples, 1)
        st.next_group_index = worker.next_group_index
        if s.eval_interval and (st.step % s.eval_interval == 0 or st.step == s.steps):
            self._launch_eval(st.step - 1, st.version)
        if s.save_interval and (st.step % s.save_interval == 0 or st.step == s.steps):
            await asyncio.to_thread(self.hooks.save, LoopState(**st.as_dict()))
        self.hooks.log(st.step - 1, metrics)
        if self.on_step is not None:
            await self.on_step(st.step - 1, metrics)

    def _launch_eval(self, step: int, version: int) -> None:
        """Evaluate `version` in the background; the score is logged on `step` whenever it returns."""
        t0 = self.clock()

        async def evaluate() -> None:
            try:
                outcome = await self.hooks.evaluate(version)
            except Exception as err:  # an eval failure must not stop training; it is logged on its step
                log.warning("evaluation of step %d (version %d) failed: %r", step, version, err)
                self.hooks.log(step, {"eval/failed": 1.0, "eval/version": float(version)})
                return
            latency = self.clock() - t0
            mixed = bool(outcome.versions_seen - {version})
            self.evals.append(EvalResult(step, version, outcome.metrics, latency, mixed))
            scores = {f"eval/{k}": v for k, v in outcome.metrics.items()}
            scores.update(
                {
                    "eval/version": float(version),
                    "eval/latency_s": latency,
                    "eval/mixed_versions": float(mixed),
                }
            )
            self.hooks.log(step, scores)

        task = asyncio.create_task(evaluate(), name=f"eval-step-{step}")
        self._eval_tasks.add(task)
        task.add_done_callback(self._eval_tasks.discard)


def run_loop(loop: AsyncLoop) -> LoopState:
    """Run the loop on a fresh event loop (for synchronous callers such as the CLI)."""
    return asyncio.run(loop.run())
