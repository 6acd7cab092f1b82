"""Tests of the fully-async rollout worker: sample-granularity refill, complete groups, failures, back-pressure.

The generate callable here is a test workload whose trajectories finish when the test says so (an
asyncio.Event per trajectory), so each property is checked at an exact, deterministic moment.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Iterator

import pytest
from lockstep.rollout.async_worker import AsyncRolloutWorker, Prompt, RolloutFailed
from lockstep.rollout.buffer import BufferClosed, GroupBuffer
from lockstep.types import Sample, SampleStatus


class GatedWorkload:
    """Trajectories that end when their gate is opened; records the peak of concurrent trajectories."""

    def __init__(self) -> None:
        self.gates: dict[tuple[int, int], asyncio.Event] = {}
        self.running = 0
        self.peak = 0
        self.fail: set[tuple[int, int]] = set()

    def gate(self, g: int, i: int) -> asyncio.Event:
        return self.gates.setdefault((g, i), asyncio.Event())

    async def __call__(self, sample: Sample) -> Sample:
        key = (sample.group_index, sample.index)
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await self.gate(*key).wait()
            if key in self.fail:
                raise RuntimeError("environment crashed")
            sample.response_ids = [5, 6]
            sample.loss_mask = [1, 1]
            sample.rollout_logprobs = [-0.1, -0.2]
            sample.token_versions = [0, 0]
            sample.reward = float(sample.index)
            return sample
        finally:
            self.running -= 1


def prompts(limit: int | None = None) -> Iterator[Prompt]:
    counter = itertools.count() if limit is None else iter(range(limit))
    return (Prompt([1, 2, i], {"answer": i}) for i in counter)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_sample_granularity_refill() -> None:
    wl = GatedWorkload()
    buf = GroupBuffer(capacity=8)
    w = AsyncRolloutWorker(wl, prompts(), buf, samples_per_prompt=2, max_in_flight=4)
    w.start()
    await settle()
    assert w.counters.submitted_groups == 2 and w.in_flight == 4  # groups 0, 1
    wl.gate(0, 0).set()
    await settle()
    assert w.counters.submitted_groups == 2  # one free credit < n
    wl.gate(1, 1).set()
    await settle()
    # Two credits from two different unfinished groups already buy a new group (group granularity would wait).
    assert w.counters.submitted_groups == 3 and w.in_flight == 4
    assert buf.queue_size == 0  # no group is complete yet
    wl.gate(0, 1).set()
    await settle()
    assert buf.queue_size == 1
    got = await buf.get()
    assert got.group.index == 0 and [s.index for s in got.group.samples] == [0, 1]
    assert got.group.samples[0].metadata == {"answer": 0}
    await w.stop()
    assert wl.peak <= 4


async def test_failures_and_timeouts_are_dropped_at_put() -> None:
    wl = GatedWorkload()
    buf = GroupBuffer(capacity=8)
    w = AsyncRolloutWorker(wl, prompts(3), buf, samples_per_prompt=2, max_in_flight=6, sample_timeout_s=0.05)
    wl.fail.add((0, 1))
    for key in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        wl.gate(*key).set()
    w.start()  # group 2 never opens its gates: both of its trajectories time out
    while buf.counters.put_groups < 3:
        await asyncio.sleep(0.01)
    assert buf.queue_size == 1 and (await buf.get()).group.index == 1
    assert w.counters.failed_samples == 1 and w.counters.timed_out_samples == 2
    assert buf.counters.aborted_groups_filtered == 2
    assert w.exhausted
    await w.wait_idle()
    await w.stop()


async def test_backpressure_when_buffer_full() -> None:
    wl = GatedWorkload()
    buf = GroupBuffer(capacity=1)
    w = AsyncRolloutWorker(wl, prompts(), buf, samples_per_prompt=1, max_in_flight=2)
    w.start()
    await settle()
    wl.gate(0, 0).set()
    wl.gate(1, 0).set()
    await settle()
    # Group 0 fills the buffer, group 1 waits at put; no new group is submitted while the buffer is full.
    assert buf.queue_size == 1
    submitted = w.counters.submitted_groups
    assert submitted <= 3  # at most one more group slipped in before the buffer filled
    for _ in range(3):
        await settle()
        assert w.counters.submitted_groups == submitted
    assert (await buf.get()).group.index == 0
    await settle()
    assert (await buf.get()).group.index == 1
    await settle()
    assert w.counters.submitted_groups > submitted  # room again: refill resumed
    await w.stop()


@pytest.mark.parametrize("seed", range(4))
async def test_groups_drawn_but_not_trained_stay_within_capacity_and_the_in_flight_budget(seed: int) -> None:
    """Generation far faster than training, trajectories of varied length: the queue stays full and
    complete groups wait at put. A complete group that had freed its last credit and was not counted
    against the buffer let the refill draw more whenever a get made room for an instant, so groups
    piled up behind the buffer, ageing (staleness). Drawn but not trained: at most the capacity plus
    what the in-flight budget can hold (each group in flight holds >= 1 credit, and a new one needs n)."""
    rng = random.Random(seed)

    async def varied(sample: Sample) -> Sample:
        for _ in range(rng.randint(1, 6)):  # event-loop turns: deterministic for a seed
            await asyncio.sleep(0)
        sample.response_ids, sample.loss_mask, sample.rollout_logprobs = [5], [1], [-0.1]
        sample.token_versions, sample.reward = [0], 1.0
        return sample

    capacity, n, max_in_flight = 4, 2, 8
    buf = GroupBuffer(capacity=capacity)
    w = AsyncRolloutWorker(varied, prompts(), buf, samples_per_prompt=n, max_in_flight=max_in_flight)
    w.start()
    drawn_not_trained = []
    for _ in range(20):
        await settle()
        drawn_not_trained.append(w.counters.submitted_groups - buf.counters.consumed_groups)
        await buf.get_batch(2)
    await w.stop()
    assert max(drawn_not_trained) <= capacity + max_in_flight - n, drawn_not_trained


async def test_in_flight_budget_must_hold_a_group() -> None:
    with pytest.raises(ValueError, match="maxInFlight"):
        AsyncRolloutWorker(
            GatedWorkload(), prompts(), GroupBuffer(capacity=1), samples_per_prompt=4, max_in_flight=3
        )


async def test_stop_cancels_in_flight() -> None:
    wl = GatedWorkload()
    w = AsyncRolloutWorker(wl, prompts(), GroupBuffer(capacity=4), samples_per_prompt=2, max_in_flight=4)
    w.start()
    await settle()
    assert wl.running == 4
    await w.stop()
    assert wl.running == 0
    assert w.metrics()["in_flight"] >= 0.0


async def test_truncated_samples_train() -> None:
    async def truncating(sample: Sample) -> Sample:
        sample.response_ids, sample.loss_mask = [1], [1]
        sample.rollout_logprobs, sample.token_versions = [-1.0], [0]
        sample.status = SampleStatus.TRUNCATED
        return sample

    buf = GroupBuffer(capacity=4)
    w = AsyncRolloutWorker(truncating, prompts(2), buf, samples_per_prompt=2, max_in_flight=2)
    w.start()
    got = [await buf.get(), await buf.get()]
    assert [c.group.index for c in got] == [0, 1]
    await w.stop()


async def test_exhausted_source_drains_then_closes() -> None:
    wl = GatedWorkload()
    buf = GroupBuffer(capacity=4)
    w = AsyncRolloutWorker(wl, prompts(2), buf, samples_per_prompt=2, max_in_flight=4)
    w.start()
    await settle()
    for key in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        wl.gate(*key).set()
    assert [(await buf.get()).group.index, (await buf.get()).group.index] == [0, 1]
    with pytest.raises(BufferClosed):  # no more data will come: the trainer is told, not left waiting
        await buf.get()
    assert w.exhausted and w.failure is None
    await w.stop()


async def test_unreachable_engine_stops_rollout() -> None:
    async def unreachable(sample: Sample) -> Sample:
        raise ConnectionError("engine at http://127.0.0.1:1 unreachable")

    buf = GroupBuffer(capacity=4)
    w = AsyncRolloutWorker(unreachable, prompts(), buf, samples_per_prompt=2, max_in_flight=4)
    w.start()
    with pytest.raises(BufferClosed):
        await buf.get()
    assert isinstance(w.failure, ConnectionError)
    assert w.counters.failed_samples == 0  # not counted as failed samples: the run stops
    await w.stop()


async def test_a_generate_that_always_fails_stops_rollout() -> None:
    async def broken_reward(sample: Sample) -> Sample:
        raise KeyError("answer")  # e.g. a reward function reading a field the task does not have

    buf = GroupBuffer(capacity=4)
    w = AsyncRolloutWorker(
        broken_reward, prompts(), buf, samples_per_prompt=2, max_in_flight=4, max_consecutive_failures=6
    )
    w.start()
    with pytest.raises(BufferClosed):
        await buf.get()
    assert isinstance(w.failure, RolloutFailed) and "KeyError: 'answer'" in str(w.failure)
    assert w.counters.failed_samples >= 6
    await w.stop()


async def test_a_usable_trajectory_resets_the_failure_count() -> None:
    wl = GatedWorkload()
    buf = GroupBuffer(capacity=8)
    w = AsyncRolloutWorker(
        wl, prompts(2), buf, samples_per_prompt=2, max_in_flight=2, max_consecutive_failures=2
    )
    wl.fail |= {(0, 0), (1, 1)}  # failed, usable, usable, failed: never two in a row
    w.start()
    for key in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        wl.gate(*key).set()
        await settle()
    await w.wait_idle()
    assert w.failure is None and w.counters.failed_samples == 2
    await w.stop()
