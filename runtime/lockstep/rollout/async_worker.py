"""The background rollout worker of fully-async training: a fixed number of trajectories in flight.

Why it exists: in a synchronous loop the trainer waits for the slowest trajectory of each batch and the
engines wait for the optimizer (§5). This worker keeps `max_in_flight` trajectories generating at
all times, independent of training, and refills at sample granularity:
- every finished trajectory frees one credit;
- each time samples_per_prompt credits are free (and the buffer has room), a whole new group is
  submitted;
- a group is assembled as its samples finish and put into the buffer only when complete.
With group-granularity refill one slow trajectory would hold all the slots of its group until it ends;
with sample granularity the in-flight count stays near the budget even when lengths differ tenfold.

Weight updates are not this worker's business: the driver pauses the engines with mode "retract", updates,
and continues. The HTTP requests of in-flight trajectories stay open; the engine re-schedules them under
the new weights, so a trajectory may span versions, which its per-token versions record.

Who calls it: lockstep.driver.fully_async (start/stop/metrics) and bench/async_longtail.py. It only needs
a `GenerateSample` callable (engine + agent + reward, provided by the driver) and a prompt source.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from lockstep.rollout.buffer import BufferClosed, GroupBuffer
from lockstep.rollout.fatal import StopsTheRun
from lockstep.types import Group, Sample, SampleStatus

log = logging.getLogger(__name__)


class RolloutFailed(RuntimeError):
    """Every recent trajectory failed: the generate callable (agent, reward, engine request) is broken,
    so the run stops instead of dropping groups forever while the trainer waits (or training nothing)."""

    reason = "RolloutFailed"
    """The reason the job fails with (the progress channel's `reason`)."""


class GenerateSample(Protocol):
    """Generates and scores one trajectory: fills response_ids, loss_mask, rollout_logprobs,
    token_versions, reward and status of the given sample and returns it. Raising marks it FAILED."""

    async def __call__(self, sample: Sample) -> Sample: ...


@dataclass(slots=True, frozen=True)
class Prompt:
    """One task item the worker turns into a group."""

    prompt_ids: list[int]
    """Token IDs of the prompt, as sent to the engine."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Task data the reward needs (e.g. the reference answer); copied into every sample."""
    position: int = -1
    """The prompt's data position (its draw index in the train split); -1 when unknown."""
    group_index: int | None = None
    """The group index to generate it under: set for a group drawn before a resume and generated
    again; None takes the worker's next index."""


@dataclass(slots=True)
class WorkerCounters:
    """Monotonic counters of the worker."""

    submitted_groups: int = 0
    """Groups submitted (n samples each)."""
    finished_samples: int = 0
    """Trajectories that ended, in any status."""
    failed_samples: int = 0
    """Trajectories whose generate callable raised (marked FAILED here)."""
    timed_out_samples: int = 0
    """Trajectories cut by the per-sample timeout (status ABORTED)."""
    completed_groups: int = 0
    """Groups whose every sample finished (then offered to the buffer)."""
    unusable_samples: int = 0
    """Trajectories that ended ABORTED or FAILED, however (their groups are dropped at put)."""
    generated_tokens: int = 0
    """Response tokens of finished trajectories."""


class AsyncRolloutWorker:
    """Keeps `max_in_flight` trajectories generating and feeds complete groups to the buffer.

    All methods run on the driver's event loop. `start()` launches the refill loop as a task;
    `stop()` cancels it and every in-flight trajectory.
    """

    def __init__(
        self,
        generate: GenerateSample,
        prompts: Iterator[Prompt],
        buffer: GroupBuffer,
        *,
        samples_per_prompt: int,
        max_in_flight: int,
        sample_timeout_s: float | None = None,
        first_group_index: int = 0,
        max_consecutive_failures: int = 64,
        on_submit: Callable[[int, Prompt], None] | None = None,
    ) -> None:
        if max_consecutive_failures < 1:
            raise ValueError(f"max_consecutive_failures must be >= 1, got {max_consecutive_failures}")
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        if max_in_flight < samples_per_prompt:
            raise ValueError(
                f"maxInFlight ({max_in_flight}) must be >= samples_per_prompt ({samples_per_prompt}): a whole "
                "group is submitted at once; raise maxInFlight"
            )
        self.generate = generate
        """Generates and scores one trajectory."""
        self.prompts = prompts
        """Where new groups' prompts come from; the worker stops submitting when it is exhausted."""
        self.buffer = buffer
        """Where complete groups go."""
        self.n = samples_per_prompt
        """Samples per group."""
        self.max_in_flight = max_in_flight
        """Trajectory budget: credits in total."""
        self.sample_timeout_s = sample_timeout_s
        """Per-trajectory wall-clock limit; a trajectory over it is ABORTED (dropped at put). None: no limit."""
        self.next_group_index = first_group_index
        """Index of the next group submitted (continues across resume)."""
        self.on_submit = on_submit
        """Called with (group index, prompt) as each group is submitted (the loop tracks what is pending)."""
        self.counters = WorkerCounters()
        """What the worker did so far."""
        self.exhausted = False
        """True once the prompt source ran out (no more groups will be submitted)."""
        self.failure: BaseException | None = None
        """Why rollout stopped early (an unreachable engine, RolloutFailed); the buffer is closed then."""
        self.max_consecutive_failures = max_consecutive_failures
        """FAILED trajectories in a row (no usable one between) that stop the run with RolloutFailed."""
        self._failed_in_a_row = 0
        self._last_error: str | None = None
        """The last trajectory error, "Type: message" (raised by the generate callable or recorded by it)."""
        self._in_flight = 0
        self._cond = asyncio.Condition()
        self._partial: dict[int, list[Sample | None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None

    @property
    def in_flight(self) -> int:
        """Trajectories generating now (credits in use)."""
        return self._in_flight

    def start(self) -> None:
        """Launch the refill loop in the background."""
        if self._loop_task is not None:
            raise RuntimeError("worker already started")
        self._loop_task = asyncio.create_task(self._refill_loop(), name="rollout-refill")

    async def stop(self) -> None:
        """Cancel the refill loop and every in-flight trajectory; partial groups are discarded."""
        tasks = [t for t in (self._loop_task, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, BufferClosed):
                await t  # a task that already ended re-raises nothing else: failures were recorded
        self._partial.clear()

    async def wait_idle(self) -> None:
        """Wait until no trajectory is in flight (e.g. after the prompt source ran out)."""
        async with self._cond:
            await self._cond.wait_for(lambda: self._in_flight == 0)

    def _credits_free(self) -> bool:
        return self.max_in_flight - self._in_flight >= self.n

    async def _refill_loop(self) -> None:
        """Submit a whole group whenever n credits are free and the buffer is not full."""
        while True:
            await self.buffer.wait_room()  # the producer blocks while the buffer is full
            async with self._cond:
                await self._cond.wait_for(self._credits_free)
            if not self.buffer.has_room():
                continue  # filled up while we waited for credits
            prompt = next(self.prompts, None)
            if prompt is None:
                self.exhausted = True
                await self._drain_and_close()
                return
            self._submit(prompt)

    async def _drain_and_close(self) -> None:
        """The prompt source ran out: let every trajectory finish and its group be put, then close the
        buffer so the trainer's get ends with BufferClosed instead of waiting forever."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self.buffer.close()

    async def _fail(self, err: BaseException) -> None:
        """An engine became unreachable: the run cannot go on. Record why and wake the trainer."""
        if self.failure is None:
            self.failure = err
            log.error("rollout stopped: %r", err)
        await self.buffer.close()

    def _submit(self, prompt: Prompt) -> None:
        gi = prompt.group_index
        if gi is None:
            gi = self.next_group_index
            self.next_group_index += 1
        if self.on_submit is not None:
            self.on_submit(gi, prompt)
        self.counters.submitted_groups += 1
        self._partial[gi] = [None] * self.n
        self._in_flight += self.n
        for i in range(self.n):
            sample = Sample(
                group_index=gi, index=i, prompt_ids=list(prompt.prompt_ids), metadata=dict(prompt.metadata)
            )
            task = asyncio.create_task(self._run_sample(sample), name=f"rollout-{gi}-{i}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _generate_one(self, sample: Sample) -> Sample:
        """Run the generate callable, turning timeouts into ABORTED and errors into FAILED."""
        try:
            return await asyncio.wait_for(self.generate(sample), self.sample_timeout_s)
        except TimeoutError:
            self.counters.timed_out_samples += 1
            sample.status = SampleStatus.ABORTED
        except (asyncio.CancelledError, ConnectionError, StopsTheRun):
            raise  # an unreachable engine is not a failed sample: the run stops (see _run_sample)
        except Exception as err:
            self.counters.failed_samples += 1
            self._last_error = f"{type(err).__name__}: {err}"
            log.warning("trajectory %d/%d failed: %r", sample.group_index, sample.index, err)
            sample.status = SampleStatus.FAILED
        return sample

    async def _run_sample(self, sample: Sample) -> None:
        try:
            done = await self._generate_one(sample)
        except (ConnectionError, StopsTheRun) as err:
            await self._fail(err)
            return
        self.counters.finished_samples += 1
        self.counters.unusable_samples += done.status in (SampleStatus.ABORTED, SampleStatus.FAILED)
        self.counters.generated_tokens += len(done.response_ids)
        self._failed_in_a_row = self._failed_in_a_row + 1 if done.status == SampleStatus.FAILED else 0
        if done.status == SampleStatus.FAILED and "error" in done.metadata:
            self._last_error = str(done.metadata["error"])  # generate caught it and recorded it on the sample
        if self._failed_in_a_row >= self.max_consecutive_failures:
            await self._fail(
                RolloutFailed(
                    f"the last {self._failed_in_a_row} trajectories failed (last error: {self._last_error}); "
                    "fix the generate/agent/reward function or the engine request it sends"
                )
            )
            return
        slots = self._partial[done.group_index]
        slots[done.index] = done
        if all(s is not None for s in slots):
            del self._partial[done.group_index]
            self.counters.completed_groups += 1
            group = Group(done.group_index, [s for s in slots if s is not None])
            try:
                # The group's last credit is held until it is in the queue: a complete group is always
                # in flight, waiting to be put (buffer.has_room counts it) or queued, never nowhere, so
                # the refill cannot draw past capacity + the in-flight budget (§5 staleness).
                await self.buffer.put(group)
            finally:
                await self._free_credit()
        else:
            await self._free_credit()

    async def _free_credit(self) -> None:
        async with self._cond:
            self._in_flight -= 1  # sample-granularity refill: this credit is free now
            self._cond.notify_all()

    def metrics(self) -> dict[str, float]:
        """Gauges and counters for the metrics sink."""
        c = self.counters
        return {
            "in_flight": float(self._in_flight),
            "max_in_flight": float(self.max_in_flight),
            "rollout_submitted_groups": float(c.submitted_groups),
            "rollout_finished_samples": float(c.finished_samples),
            "rollout_unusable_samples": float(c.unusable_samples),
            "rollout_failed_samples": float(c.failed_samples),
            "rollout_timed_out_samples": float(c.timed_out_samples),
            "rollout_generated_tokens": float(c.generated_tokens),
        }
