"""The work queue on fake time: one pass per object at a time, kicks during a pass fold into exactly one
more, failures retry with doubling backoff, a vanished object is not retried. Nothing sleeps: the
queue's clock is a FakeClock whose sleeps wake only when the test advances time."""

from __future__ import annotations

import asyncio
import heapq

from lockstep_operator.k8s.client import ApiError
from lockstep_operator.workqueue import Backoff, Key, WorkQueue

KEY: Key = ("RLJob", "ns", "a")


class FakeClock:
    """Virtual time: sleep() waits until advance() moves the clock past its deadline."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []
        self._timers: list[tuple[float, int, asyncio.Future[None]]] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._timers, (self.now + seconds, id(future), future))
        await future

    async def advance(self, seconds: float) -> None:
        """Move time forward, waking every sleeper whose deadline passed, in deadline order."""
        end = self.now + seconds
        await settle()
        while self._timers and self._timers[0][0] <= end:
            deadline, _, future = heapq.heappop(self._timers)
            self.now = deadline
            future.set_result(None)
            await settle()
        self.now = end


async def settle() -> None:
    """Let every ready task run until it blocks again (no real time passes)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_kicks_during_a_pass_cause_exactly_one_more_after_the_settle() -> None:
    release, runs = asyncio.Event(), []

    async def run(key: Key) -> None:
        runs.append(key)
        await release.wait()

    clock = FakeClock()
    queue = WorkQueue(run, backoff=Backoff(settle_s=0.25), clock=clock)
    queue.kick(KEY)
    await settle()
    for _ in range(5):
        queue.kick(KEY)  # arrive while the first pass runs
    queue.kick(("RLJob", "ns", "b"))  # another object runs in parallel
    await settle()
    assert runs == [KEY, ("RLJob", "ns", "b")] and queue.in_flight == 2
    release.set()
    await clock.advance(0.24)
    assert runs.count(KEY) == 1  # the extra pass waits for the burst to settle
    await clock.advance(0.01)
    assert runs.count(KEY) == 2 and queue.in_flight == 0 and clock.slept == [0.25]


async def test_a_failed_pass_is_retried_with_doubling_backoff_up_to_the_cap() -> None:
    calls: list[float] = []
    clock = FakeClock()

    async def run(key: Key) -> None:
        calls.append(clock.now)
        if len(calls) <= 5:
            raise RuntimeError("apiserver hiccup")

    queue = WorkQueue(run, backoff=Backoff(initial_s=0.5, max_s=3.0, settle_s=0.25), clock=clock)
    queue.kick(KEY)
    await clock.advance(100)
    # Each retry waits the backoff, then the settle pause of a pass that is due again.
    assert clock.slept == [0.5, 0.25, 1.0, 0.25, 2.0, 0.25, 3.0, 0.25, 3.0, 0.25]
    assert len(calls) == 6 and queue.in_flight == 0


async def test_success_resets_the_backoff() -> None:
    clock, outcomes = FakeClock(), [RuntimeError("a"), RuntimeError("b"), None, RuntimeError("c"), None]

    async def run(key: Key) -> None:
        if (err := outcomes.pop(0)) is not None:
            raise err

    queue = WorkQueue(run, backoff=Backoff(initial_s=1.0, max_s=60.0, settle_s=0.0), clock=clock)
    queue.kick(KEY)
    await clock.advance(10)
    queue.kick(KEY)
    await clock.advance(10)
    assert [s for s in clock.slept if s] == [1.0, 2.0, 1.0] and not outcomes


async def test_an_object_deleted_during_its_pass_is_not_retried() -> None:
    calls = []

    async def run(key: Key) -> None:
        calls.append(key)
        raise ApiError(404, "NotFound", 'rljobs.rl.lockstep.dev "a" not found')

    clock = FakeClock()
    queue = WorkQueue(run, clock=clock)
    queue.kick(KEY)
    await clock.advance(100)
    assert calls == [KEY] and clock.slept == [] and queue.in_flight == 0


async def test_close_cancels_pending_passes() -> None:
    async def run(key: Key) -> None:
        raise RuntimeError("always")

    clock = FakeClock()
    queue = WorkQueue(run, clock=clock)
    queue.kick(KEY)
    await settle()
    assert queue.in_flight == 1  # waiting in its backoff
    await queue.close()
    assert queue.in_flight == 0
