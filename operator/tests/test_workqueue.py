"""The work queue on fake time: one pass per object at a time, kicks during a pass fold into exactly one
more, failures retry with doubling backoff (kicks wait for it, urgent ones do not), a vanished object
is not retried, the global token bucket paces pass starts and at most max_concurrent passes run. Nothing
sleeps: the queue's clock is a FakeClock whose sleeps wake only when the test advances time."""

from __future__ import annotations

import asyncio
import heapq

from lockstep_operator.k8s.client import ApiError
from lockstep_operator.workqueue import Backoff, Key, RateLimit, WorkQueue

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
            if future.done():  # a sleep that was cancelled (an urgent kick ended a backoff)
                continue
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


async def test_kicks_during_a_failure_backoff_wait_for_it_and_an_urgent_one_does_not() -> None:
    clock, calls = FakeClock(), []

    async def run(key: Key) -> None:
        calls.append(clock.now)
        raise ApiError(403, "Forbidden", 'pods "x" is forbidden: violates PodSecurity "restricted:latest"')

    queue = WorkQueue(run, backoff=Backoff(initial_s=8.0, max_s=60.0, settle_s=0.0), clock=clock)
    queue.kick(KEY)
    await clock.advance(1)
    for _ in range(10):  # a burst of pod events while the pass is refused
        queue.kick(KEY)
    await clock.advance(6)
    assert calls == [0.0]  # still waiting out the 8 s backoff: no retry per event
    queue.kick(KEY, urgent=True)  # the user edited the spec
    await clock.advance(0)
    assert calls == [0.0, 7.0]
    await queue.close()


async def test_the_token_bucket_paces_pass_starts_over_all_objects() -> None:
    clock, starts = FakeClock(), []

    async def run(key: Key) -> None:
        starts.append((key[2], clock.now))

    queue = WorkQueue(run, limit=RateLimit(qps=2.0, burst=3, max_concurrent=100), clock=clock)
    for name in "abcdefg":
        queue.kick(("RLJob", "ns", name))
    await clock.advance(10)
    times = [t for _, t in starts]
    assert times == [0.0, 0.0, 0.0, 0.5, 1.0, 1.5, 2.0]  # the burst, then 2 per second, in order
    assert [n for n, _ in starts] == list("abcdefg")


async def test_no_more_than_max_concurrent_passes_run_at_once() -> None:
    release, peak = asyncio.Event(), []
    queue: WorkQueue

    async def run(key: Key) -> None:
        peak.append(queue.running)
        await release.wait()

    queue = WorkQueue(run, limit=RateLimit(qps=1000.0, burst=1000, max_concurrent=3), clock=FakeClock())
    for i in range(10):
        queue.kick(("Pod", "ns", str(i)))
    await settle()
    assert queue.running == 3 and queue.in_flight == 10
    release.set()
    for _ in range(10):
        await settle()
    assert max(peak) == 3 and len(peak) == 10 and queue.in_flight == 0


async def test_the_re_check_comes_resync_s_after_the_first_pass_however_often_the_key_passes() -> None:
    """Passes of a job every 10 s do not postpone the re-check of its family (it came never before)."""
    clock, kicked = FakeClock(), []
    child: Key = ("WeightChannel", "ns", "a-weights")

    async def run(key: Key) -> None:
        kicked.append((clock.now, key))

    queue = WorkQueue(
        run,
        backoff=Backoff(settle_s=0.0),
        clock=clock,
        resync=lambda k: [k, child] if k == KEY else [],
        resync_s=60.0,
    )
    for _ in range(13):  # a pass of the job every 10 s for 130 s
        queue.kick(KEY)
        await clock.advance(10)
    children = [when for when, key in kicked if key == child]
    assert children == [60.0, 120.0], kicked


async def test_a_deleted_job_is_never_re_checked_again() -> None:
    """The operator's re-check (handlers._recheck) with the queue: a job passes, its family is re-checked
    each period; once its DELETED event removed it from the cache, a late kick (its pods' deletions kick
    it) passes once and arms nothing. Before, that pass armed the timer again: every deleted job's
    family passed each period for as long as the operator ran (4 passes a minute per job ever deleted)."""
    import kopf
    import lockstep_operator.handlers as handlers
    from lockstep_operator.k8s.store import Store

    job = {
        "apiVersion": "rl.lockstep.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "a", "namespace": "ns", "uid": "u1", "resourceVersion": "1"},
    }
    store = Store({})
    store.observe(job)
    clock, ran = FakeClock(), []

    async def run(key: Key) -> None:
        ran.append(key)

    memo = kopf.Memo(store=store)
    memo["queue"] = queue = WorkQueue(run, clock=clock, resync=lambda key: handlers._recheck(memo, key))
    queue.kick(KEY)
    await clock.advance(61)
    assert ran == [KEY, *handlers._family("a", "ns")]  # the first pass, then the re-check at 60 s
    await handlers.rljob_event(type="DELETED", name="a", namespace="ns", body=kopf.Body(job), memo=memo)
    ran.clear()
    queue.kick(KEY)  # a late event of the deleted job's pod
    await clock.advance(600)
    assert ran == [KEY], f"{len(ran)} passes of a deleted job in 10 min"
    await queue.close()
