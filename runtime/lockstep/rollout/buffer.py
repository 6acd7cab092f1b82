"""The bounded buffer of complete groups between the rollout worker and the trainer (§5).

Why it exists: fully-async training decouples generation from training; this FIFO joins them. It gives
back-pressure (the producer waits when it is full, complete groups waiting to be put included) and applies the two kinds of checks at the moment
each can be decided:
- at put: failures and timeouts (a group with an aborted or failed sample is dropped) and user filters
  (plugins named by import path). Their verdict cannot change after generation ends.
- at get: staleness against the current published version, because a group keeps getting older while it
  waits; a group with S_old strictly above the bound is dropped (no bound by default).
Every drop is counted; queue_size and the staleness distributions are the run's main diagnostics (near
zero: rollout is the bottleneck; at capacity: training is, and the data gets older).

Who calls it: lockstep.rollout.async_worker (put), lockstep.driver.fully_async (get, set_version,
metrics). Everything runs on one asyncio event loop; the trainer's blocking work runs in a thread.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from lockstep.rollout.plugins import load_function
from lockstep.rollout.staleness import Staleness, StalenessStats, is_too_stale, measure_staleness
from lockstep.types import Group, SampleStatus

GroupFilter = Callable[[Group], bool]
"""A user filter: called at put with a complete, scored group; returns True to keep it."""


class BufferClosed(Exception):
    """Raised by put/get once the buffer is closed (the run is ending)."""


def load_group_filter(path: str, field_path: str = "group filter") -> GroupFilter:
    """Import a user filter by its path, `package.module:function` (or `package.module.function`),
    with the same checks and errors as the manifest's other plugin paths (ValueError naming field_path)."""
    if ":" not in path and "." in path:
        module_name, _, attr = path.rpartition(".")
        path = f"{module_name}:{attr}"
    fn: GroupFilter = load_function(path, field_path)
    return fn


RUN_COUNTERS = ("consumed_groups", "stale_groups_filtered", "aborted_groups_filtered", "filtered_groups")
"""The counters of the run, not of the process: each counts groups whose fate (trained or dropped) is
decided, once per group, so a checkpoint saves them and a resumed run counts on from them (a group
still pending at the checkpoint is decided after the resume). put_groups and accepted_groups are not:
a pending group is offered and accepted again after a resume."""


@dataclass(slots=True)
class BufferCounters:
    """Monotonic counters of what went through the buffer (RUN_COUNTERS continue across a resume)."""

    put_groups: int = 0
    """Groups offered to put (accepted or not)."""
    accepted_groups: int = 0
    """Groups that entered the queue."""
    aborted_groups_filtered: int = 0
    """Groups dropped at put because a sample was aborted, failed or timed out."""
    filtered_groups: int = 0
    """Groups dropped at put by a user filter."""
    stale_groups_filtered: int = 0
    """Groups dropped at get because S_old exceeded the bound."""
    consumed_groups: int = 0
    """Groups handed to the trainer."""

    def run_counts(self) -> dict[str, int]:
        """The counts of decided groups (RUN_COUNTERS) that a checkpoint carries."""
        return {name: getattr(self, name) for name in RUN_COUNTERS}

    @classmethod
    def resumed(cls, counts: Mapping[str, int]) -> BufferCounters:
        """Counters that count on from a checkpoint's run_counts() (names outside RUN_COUNTERS start
        at 0: a regenerated group is offered and accepted again)."""
        return cls(**{name: int(counts.get(name, 0)) for name in RUN_COUNTERS})


@dataclass(slots=True)
class Consumed:
    """A group handed to the trainer with its staleness measured at that moment."""

    group: Group
    """The complete group, in sample-index order."""
    staleness: Staleness
    """Its staleness against the version published when it was taken."""


@dataclass(slots=True)
class GroupBuffer:
    """A bounded FIFO of complete groups; all methods must be called from one event loop."""

    capacity: int
    """Maximum queued groups; the producer blocks at put while the queue holds this many (default 2 x batch)."""
    max_staleness: int | None = None
    """Bound on S_old in published versions; None (default) never rejects. Checked at get."""
    filters: Sequence[GroupFilter] = ()
    """User filters applied at put, in order; a group is dropped by the first that returns False."""
    version: int = 0
    """The currently published rollout weight version (v_c), advanced by the driver after each update."""
    counters: BufferCounters = field(default_factory=BufferCounters)
    """What went through the buffer so far."""
    window: StalenessStats = field(default_factory=StalenessStats)
    """Staleness of the groups consumed since the last take_window()."""
    dropped: list[int] = field(default_factory=list)
    """Indices of the groups dropped (at put or at get) since the last take_dropped()."""
    _queue: deque[Group] = field(default_factory=deque, init=False, repr=False)
    _cond: asyncio.Condition = field(default_factory=asyncio.Condition, init=False, repr=False)
    _closed: bool = field(default=False, init=False)
    _waiting_puts: int = field(default=0, init=False)
    """Complete groups inside put (waiting for room): they count against the capacity at wait_room."""

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(
                f"buffer capacity must be >= 1 group, got {self.capacity}; default is 2 x batch groups"
            )
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"maxWeightStaleness must be >= 0 or unset, got {self.max_staleness}")

    @property
    def queue_size(self) -> int:
        """Groups waiting for the trainer now."""
        return len(self._queue)

    def has_room(self) -> bool:
        """True when a group submitted now has a place: queued groups plus complete groups waiting to
        be put are below capacity. A complete group has freed its credits while it waits at put;
        counting it keeps the groups drawn but not trained within capacity + the in-flight budget,
        else they pile up behind a full queue and age without bound (staleness)."""
        return len(self._queue) + self._waiting_puts < self.capacity

    def _rejected_at_put(self, group: Group) -> bool:
        """Apply failures/timeouts and user filters; count and report a drop."""
        if any(s.status in (SampleStatus.ABORTED, SampleStatus.FAILED) for s in group.samples):
            self.counters.aborted_groups_filtered += 1
            self.dropped.append(group.index)
            return True
        for keep in self.filters:
            if not keep(group):
                self.counters.filtered_groups += 1
                self.dropped.append(group.index)
                return True
        return False

    async def put(self, group: Group) -> bool:
        """Offer a complete group; wait while the queue is full. Returns False when it was filtered out."""
        self.counters.put_groups += 1
        if self._rejected_at_put(group):
            return False
        self._waiting_puts += 1  # at once: the refill must see it before this put gets the lock
        try:
            async with self._cond:
                await self._cond.wait_for(lambda: self._closed or len(self._queue) < self.capacity)
                if self._closed:
                    raise BufferClosed("buffer closed while a group waited to be put")
                self._queue.append(group)
                self.counters.accepted_groups += 1
                self._cond.notify_all()
        finally:
            self._waiting_puts -= 1
        return True

    async def wait_room(self) -> None:
        """Wait until has_room() (the worker submits new groups only then)."""
        async with self._cond:
            await self._cond.wait_for(lambda: self._closed or self.has_room())
            if self._closed:
                raise BufferClosed("buffer closed")

    async def get(self) -> Consumed:
        """Take the oldest group that is fresh enough; wait while none is queued. Stale groups are dropped."""
        async with self._cond:
            while True:
                await self._cond.wait_for(lambda: self._closed or bool(self._queue))
                if not self._queue:
                    raise BufferClosed("buffer closed and empty")
                group = self._queue.popleft()
                self._cond.notify_all()  # room for the producer
                st = measure_staleness(group.token_versions(), self.version)
                if is_too_stale(st, self.max_staleness):
                    self.counters.stale_groups_filtered += 1
                    self.dropped.append(group.index)
                    continue
                self.counters.consumed_groups += 1
                self.window.add(st)
                return Consumed(group, st)

    async def get_batch(self, n_groups: int) -> list[Consumed]:
        """Take n complete, fresh-enough groups in FIFO order (one step's batch)."""
        return [await self.get() for _ in range(n_groups)]

    async def set_version(self, version: int) -> None:
        """Record a newly published version; groups queued now are measured against it at get."""
        if version < self.version:
            raise ValueError(f"published version went backwards: {self.version} -> {version}")
        async with self._cond:
            self.version = version

    async def close(self) -> None:
        """Wake every waiter with BufferClosed; queued groups stay readable by get until empty."""
        async with self._cond:
            self._closed = True
            self._cond.notify_all()

    def take_dropped(self) -> list[int]:
        """The indices of the groups dropped since the last call (a dropped group is consumed: a
        resumed run never generates it again)."""
        out, self.dropped = self.dropped, []
        return out

    def take_window(self) -> StalenessStats:
        """Return the staleness of the groups consumed since the last call and start a new window."""
        window, self.window = self.window, StalenessStats()
        return window

    def metrics(self) -> dict[str, float]:
        """Queue gauges and counters for the metrics sink (names as in §5)."""
        c = self.counters
        return {
            "queue_size": float(len(self._queue)),
            "queue_capacity": float(self.capacity),
            "stale_groups_filtered": float(c.stale_groups_filtered),
            "aborted_groups_filtered": float(c.aborted_groups_filtered),
            "filtered_groups": float(c.filtered_groups),
            "consumed_groups": float(c.consumed_groups),
        }
