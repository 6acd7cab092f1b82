"""Client-side priority for the operator's API requests: at most `limit` in flight, the urgent first.

Why it exists: without it every pass of a burst sends its requests at once and the API server serves
them in no useful order, so the last job's pods wait behind every other job's supporting objects
(policy.request_priority says which requests are urgent). With a bound on requests in flight the
waiting ones queue here: the urgent ones first, each class oldest first; the others take at most half
of the slots, and while urgent requests are in flight or waiting a thirty-second (one of the default
32), so that an urgent request shares the API server's CPU with few of them (on a loaded API server
each request in flight gets about an equal share, so the others' slots are what they take from the
pods; bench/results/operator_apply_2026-12-06_cpu.md); an other request that
has waited `max_wait_s` goes before the urgent ones, so a steady stream of those cannot starve the
rest (a job's ConfigMaps, RBAC and statuses follow within that bound). A request holds its slot only
while it is on the wire (KubeClient takes one per attempt, never across a retry's pause). With nothing
urgent waiting, the others go at once up to their half. The time waited is a metric
(lockstep_operator_api_request_wait_seconds). Who uses it: KubeClient, built by handlers for the
operator (tests and benches use the client without a gate).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from lockstep_operator import metrics

_Waiter = tuple[float, "asyncio.Future[None]"]


class RequestGate:
    """At most `limit` requests in flight, at most half of them not urgent (a thirty-second while urgent
    ones are in flight or waiting); the waiting ones go urgent first, each class oldest first, and one
    that waited `max_wait_s` goes next whatever its class."""

    def __init__(
        self,
        limit: int,
        max_wait_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        other_limit: int | None = None,
        busy_other_limit: int | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError(f"the gate's limit must be at least 1, not {limit}")
        self.limit, self.max_wait_s, self.clock = limit, max_wait_s, clock
        self.other_limit = other_limit or max(1, limit // 2)
        """At most this many of the other (not urgent) requests in flight: the rest of the slots stay
        free for urgent ones, which then share the API server with fewer others."""
        self.busy_other_limit = min(self.other_limit, busy_other_limit or max(1, limit // 32))
        """At most this many others in flight while an urgent request is in flight or waiting."""
        self.in_flight = 0
        """Requests holding a slot now."""
        self.other_in_flight = 0
        """Other (not urgent) requests among them."""
        self._urgent: deque[_Waiter] = deque()
        self._other: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._urgent) + len(self._other)

    @asynccontextmanager
    async def slot(self, urgent: bool) -> AsyncIterator[None]:
        """Hold one of the `limit` slots for the body (one request attempt)."""
        await self._acquire(urgent)
        try:
            yield
        finally:
            self._release(urgent)

    def _free(self, urgent: bool) -> bool:
        if self.in_flight >= self.limit:
            return False
        return urgent or self.other_in_flight < self._other_cap()

    def _other_cap(self) -> int:
        busy = bool(self._urgent) or self.in_flight > self.other_in_flight
        return self.busy_other_limit if busy else self.other_limit

    async def _acquire(self, urgent: bool) -> None:
        label = "urgent" if urgent else "other"
        if self._free(urgent) and not (self._urgent if urgent else self.waiting):
            self._take(urgent)
            metrics.API_REQUEST_WAIT.labels(label).observe(0.0)
            return
        queue = self._urgent if urgent else self._other
        entry: _Waiter = (self.clock(), asyncio.get_running_loop().create_future())
        queue.append(entry)
        try:
            await entry[1]  # granted: the slot was counted for us (_grant)
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():
                self._release(urgent)  # granted, then cancelled before using it: hand it on
            elif entry in queue:
                queue.remove(entry)
            raise
        metrics.API_REQUEST_WAIT.labels(label).observe(self.clock() - entry[0])

    def _take(self, urgent: bool) -> None:
        self.in_flight += 1
        self.other_in_flight += 0 if urgent else 1

    def _release(self, urgent: bool) -> None:
        self.in_flight -= 1
        self.other_in_flight -= 0 if urgent else 1
        self._grant()

    def _grant(self) -> None:
        while True:
            picked = self._next()
            if picked is None:
                return
            urgent, entry = picked
            if entry[1].done():  # its waiter was cancelled
                continue
            self._take(urgent)
            entry[1].set_result(None)

    def _next(self) -> tuple[bool, _Waiter] | None:
        """The waiter served next, if a slot is free for it: an overdue other one, else the oldest
        urgent one, else the oldest other one (while fewer than other_limit others are in flight)."""
        if self.in_flight >= self.limit:
            return None
        overdue = bool(self._other) and self.clock() - self._other[0][0] >= self.max_wait_s
        if overdue and self._free(False):
            return False, self._other.popleft()
        if self._urgent:
            return True, self._urgent.popleft()
        if self._other and self._free(False):
            return False, self._other.popleft()
        return None
