"""The work queue: at most one reconcile per object at a time, kicks folded, failures retried.

Why it exists: the operator is level-triggered. Every watch event and the periodic timer only *kick*
a key (kind, namespace, name); a burst of pod events then costs one or two passes, and two passes of
one object never race. A kick during a pass causes exactly one more pass, after a short settle (our
own status writes echo back as events). A pass that raises is retried with doubling backoff; a 404
means the object went away during the pass (a re-created object brings its own event). Time comes
from an injected `Clock`, so tests run on fake time without sleeping (operator/tests/test_workqueue.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
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


@dataclass
class WorkQueue:
    """Runs `run(key)` for kicked keys: one pass per key at a time, extra kicks folded into one more."""

    run: Callable[[Key], Awaitable[None]]
    """The reconcile of one key."""
    backoff: Backoff = field(default_factory=Backoff)
    """Retry and settle timing."""
    clock: Clock = field(default_factory=RealClock)
    """Time source (tests inject a fake one)."""
    _tasks: dict[Key, asyncio.Task[None]] = field(default_factory=dict, init=False)
    _dirty: set[Key] = field(default_factory=set, init=False)

    @property
    def in_flight(self) -> int:
        """Keys with a pass running or pending (the liveness probe reports it)."""
        return len(self._tasks)

    def kick(self, key: Key) -> None:
        """Schedule a pass of `key` (now, or right after the running one)."""
        if key in self._tasks:
            self._dirty.add(key)
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
                else:  # a failed pass is retried, never lost
                    log.warning("reconcile of %s %s/%s failed (retry in %.1fs)", *key, delay)
                    await self.clock.sleep(delay)
                    delay = min(delay * 2, self.backoff.max_s)
                    self._dirty.add(key)
                if key not in self._dirty:
                    return
                # Kicked during the pass: let the burst settle, then one pass covers all of it.
                await self.clock.sleep(self.backoff.settle_s)
        finally:
            self._tasks.pop(key, None)
            metrics.QUEUED.set(len(self._tasks))

    async def _pass(self, key: Key) -> bool:
        """One pass; False when it failed and must be retried."""
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
        """Cancel every pending pass (operator shutdown)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
