"""The work queue: at most one reconcile per object at a time, kicks folded, failures retried with
backoff, a global rate limit and a cap on concurrent passes (controller-runtime's shape).

Why it exists: the operator is level-triggered. Every watch event and the periodic timer only *kick*
a key (kind, namespace, name); a burst of pod events then costs one or two passes, and two passes of
one object never race. A kick during a pass causes exactly one more pass, after a short settle (our
own status writes echo back as events). A pass that raises is retried with per-object doubling
backoff (1 s to 2 min by default); kicks that arrive meanwhile wait for the retry instead of
hammering a refused request, unless they are urgent (a user changed the object's spec). A 404 means
the object went away during the pass (a re-created object brings its own event). Over all objects:
every pass takes a token from one bucket (`RateLimit.qps`, `burst`), so a storm of events or a bug
that loops cannot flood the API server, and at most `max_concurrent` passes run at once. A successful
pass arms the key's re-check timer (`resync`) unless it is armed: passes never postpone it. Time comes
from an injected `Clock`, so tests run on fake time without sleeping (operator/tests/test_workqueue.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lockstep_operator import metrics
from lockstep_operator.k8s.client import ApiError

Key = tuple[str, str, str]
"""(kind, namespace, name) of an object to reconcile (the same alias as lockstep_operator.reconcile.Key)."""
log = logging.getLogger("lockstep_operator")


class Clock(Protocol):
    """What the queue needs of time: a monotonic reading and an awaitable sleep."""

    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    """time.monotonic and asyncio.sleep."""

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Retry timing of failed passes."""

    initial_s: float = 0.5
    """Pause before the first retry."""
    max_s: float = 30.0
    """Longest pause (the pause doubles up to this)."""
    settle_s: float = 0.25
    """Pause before the extra pass that kicks during a pass caused."""


@dataclass(frozen=True, slots=True)
class RateLimit:
    """Limits over every object together."""

    qps: float = 50.0
    """Passes started per second, on average (the token bucket's refill rate)."""
    burst: int = 200
    """Passes that may start at once before the rate applies (the bucket's size)."""
    max_concurrent: int = 32
    """Passes running at the same time."""


class TokenBucket:
    """A reservation token bucket on the queue's clock: `take()` returns once a token is free.

    Each taker reserves its token at once (the level may go negative) and sleeps until the refill
    covers it, so waiters are served in arrival order without polling.
    """

    def __init__(self, qps: float, burst: int, clock: Clock) -> None:
        self.qps, self.burst, self.clock = qps, float(burst), clock
        self._tokens, self._at = float(burst), clock.monotonic()

    def reserve(self) -> float:
        """Take one token; the seconds to wait before using it (0 when one was free)."""
        now = self.clock.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.qps)
        self._at = now
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0 else -self._tokens / self.qps

    async def take(self) -> float:
        """Wait for a token; the seconds waited."""
        delay = self.reserve()
        if delay > 0:
            await self.clock.sleep(delay)
        return delay


@dataclass
class WorkQueue:
    """Runs `run(key)` for kicked keys: one pass per key at a time, extra kicks folded into one more."""

    run: Callable[[Key], Awaitable[None]]
    """The reconcile of one key."""
    backoff: Backoff = field(default_factory=Backoff)
    """Retry and settle timing."""
    limit: RateLimit = field(default_factory=RateLimit)
    """Global rate and concurrency limits."""
    clock: Clock = field(default_factory=RealClock)
    """Time source (tests inject a fake one)."""
    resync: Callable[[Key], Sequence[Key]] = field(default=lambda key: ())
    """Keys to kick `resync_s` after a successful pass of `key` (controller-runtime's RequeueAfter): the
    periodic level-triggered re-check. Empty: none."""
    resync_s: float = 60.0
    """Period of the re-check."""
    _timers: dict[Key, asyncio.Task[None]] = field(default_factory=dict, init=False)
    _tasks: dict[Key, asyncio.Task[None]] = field(default_factory=dict, init=False)
    _dirty: set[Key] = field(default_factory=set, init=False)
    _wake: dict[Key, asyncio.Event] = field(default_factory=dict, init=False)
    _bucket: TokenBucket | None = field(default=None, init=False)
    _slots: asyncio.Semaphore | None = field(default=None, init=False)
    _closed: bool = field(default=False, init=False)
    running: int = field(default=0, init=False)
    """Passes running now (never more than limit.max_concurrent)."""

    @property
    def in_flight(self) -> int:
        """Keys with a pass running or pending (the liveness probe reports it)."""
        return len(self._tasks)

    def kick(self, key: Key, *, urgent: bool = False) -> None:
        """Schedule a pass of `key` (now, or right after the running one). A key waiting out its
        failure backoff waits on, unless `urgent` (the user changed it: retry at once). Ignored once
        closed (a watch event that arrives during shutdown)."""
        if self._closed:
            return
        if key in self._tasks:
            self._dirty.add(key)
            if urgent and key in self._wake:
                self._wake[key].set()
            return
        self._tasks[key] = asyncio.get_running_loop().create_task(self._loop(key))
        metrics.QUEUED.set(len(self._tasks))

    async def _loop(self, key: Key) -> None:
        delay = self.backoff.initial_s
        try:
            while True:
                self._dirty.discard(key)
                if await self._pass(key):
                    delay = self.backoff.initial_s
                    self._requeue(key)
                else:  # a failed pass is retried, never lost
                    log.warning("reconcile of %s %s/%s failed (retry in %.1fs)", *key, delay)
                    metrics.RETRIES.labels(key[0]).inc()
                    await self._backoff(key, delay)
                    delay = min(delay * 2, self.backoff.max_s)
                    self._dirty.add(key)
                if key not in self._dirty:
                    return
                # Kicked during the pass: let the burst settle, then one pass covers all of it.
                await self.clock.sleep(self.backoff.settle_s)
        finally:
            self._tasks.pop(key, None)
            self._wake.pop(key, None)
            metrics.QUEUED.set(len(self._tasks))

    def _requeue(self, key: Key) -> None:
        """Start the re-check timer of `key` unless one is armed. A pass never postpones it (as
        controller-runtime's AddAfter keeps the earliest time): the re-check kicks the job's children
        too, and a job whose own passes came more often than `resync_s` (its children's status writes
        kick it) would otherwise never re-check them, leaving a missed kick of a child unrepaired."""
        keys = tuple(self.resync(key))
        if not keys or key in self._timers:
            return
        self._timers[key] = asyncio.get_running_loop().create_task(self._later(key, keys))

    async def _later(self, key: Key, keys: Sequence[Key]) -> None:
        await self.clock.sleep(self.resync_s)
        self._timers.pop(key, None)
        for other in keys:
            self.kick(other)

    def forget(self, key: Key) -> None:
        """The object is gone: drop its re-check timer."""
        if (timer := self._timers.pop(key, None)) is not None:
            timer.cancel()

    async def _backoff(self, key: Key, seconds: float) -> None:
        """Sleep `seconds`, or less if an urgent kick arrives."""
        wake = self._wake[key] = asyncio.Event()
        sleeper = asyncio.ensure_future(self.clock.sleep(seconds))
        waiter = asyncio.ensure_future(wake.wait())
        try:
            await asyncio.wait((sleeper, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sleeper, waiter):
                task.cancel()
            self._wake.pop(key, None)

    async def _pass(self, key: Key) -> bool:
        """One pass (after a token and a free slot); False when it failed and must be retried."""
        if self._bucket is None or self._slots is None:
            self._bucket = TokenBucket(self.limit.qps, self.limit.burst, self.clock)
            self._slots = asyncio.Semaphore(self.limit.max_concurrent)
        waited = await self._bucket.take()
        if waited:
            metrics.RATE_LIMITED_SECONDS.inc(waited)
        async with self._slots:
            self.running += 1
            try:
                return await self._timed(key)
            finally:
                self.running -= 1

    async def _timed(self, key: Key) -> bool:
        started = self.clock.monotonic()
        try:
            await self.run(key)
            metrics.RECONCILES.labels(key[0], "ok").inc()
            return True
        except ApiError as err:
            if err.status != 404:
                return self._failed(key, err)
            metrics.RECONCILES.labels(key[0], "gone").inc()
            return True
        except Exception as err:
            return self._failed(key, err)
        finally:
            metrics.RECONCILE_SECONDS.labels(key[0]).observe(self.clock.monotonic() - started)

    def _failed(self, key: Key, err: Exception) -> bool:
        metrics.RECONCILES.labels(key[0], "error").inc()
        metrics.ERRORS.labels(key[0], type(err).__name__).inc()
        log.warning("reconcile of %s %s/%s raised: %s", *key, err)
        return False

    async def close(self) -> None:
        """Cancel every pending pass and timer (operator shutdown); later kicks are ignored."""
        self._closed = True
        tasks = list(self._tasks.values()) + list(self._timers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
