"""Preemption: on SIGTERM the driver reaches a safe point at once and checkpoints within the grace period.

Why it exists: cloud GPUs give 30-120 s of notice, and a pod deletion or a node drain is a SIGTERM
followed, after the pod's terminationGracePeriodSeconds (spec.schedule.preemptionGraceSeconds, set by
the operator), by SIGKILL. Finishing the current step, as Ctrl-C does, can take longer than that (a
whole rollout wave). So SIGTERM also sets `Preemption.event`, which both loops watch while they wait
for rollouts: the sync loop abandons the batch it is collecting (its prompts are drawn again after the
resume), the fully-async loop stops waiting for the buffer (the groups it held stay pending in the
checkpoint); a train step or weight update already running is finished (it cannot be interrupted),
then the checkpoint is written. The time from SIGTERM to the durable checkpoint is logged as a
`preemption` row in metrics.jsonl (`sigterm_to_checkpoint_s`).

With a trainer group, the driver announces with every train the state after that step
(`announce_state`), so rank 0 can checkpoint it when its own pod gets SIGTERM
(lockstep.trainer.server).

Who calls it: lockstep.cli.run (installs the handler), lockstep.driver.steps and
lockstep.driver.fully_async (wait under `until_preempted`), lockstep.driver.loop (logs the row).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from lockstep.trainer.state import DriverState

log = logging.getLogger(__name__)

_T = TypeVar("_T")
POLL_S = 0.05
"""How often a wait checks for SIGTERM (the latency it adds to reaching a safe point)."""


class Preempted(Exception):
    """SIGTERM arrived while the loop waited for rollouts: the wait was abandoned."""


@dataclass(slots=True)
class Preemption:
    """SIGTERM's state for one run."""

    event: threading.Event = field(default_factory=threading.Event)
    """Set by SIGTERM."""
    at: float | None = None
    """time.monotonic() of the SIGTERM."""
    save_s: float | None = None
    """Seconds the checkpoint after SIGTERM took to write (the rest is reaching the safe point)."""
    saved_at: float | None = None
    """time.monotonic() when that checkpoint was durable."""
    clock: Callable[[], float] = time.monotonic

    def trigger(self) -> None:
        """What SIGTERM does (also callable from tests)."""
        if self.at is None:
            self.at = self.clock()
        self.event.set()

    def timed_save(self, save: Callable[[], object]) -> None:
        """Run the checkpoint `save`, timing it when it follows a SIGTERM."""
        t0 = self.clock()
        save()
        if self.at is not None:
            self.saved_at = self.clock()
            self.save_s = self.saved_at - t0

    def seconds_since(self) -> float | None:
        """Seconds since SIGTERM, None when none came."""
        return None if self.at is None else self.clock() - self.at

    def seconds_to_checkpoint(self) -> float | None:
        """Seconds from SIGTERM to the durable checkpoint (to now when none was written after it)."""
        if self.at is None:
            return None
        return (self.saved_at if self.saved_at is not None else self.clock()) - self.at

    def install(self, stop: threading.Event) -> None:
        """SIGTERM -> trigger and `stop` (the loop ends after reaching a safe point and saving, within
        the pod's grace period: spec.schedule.preemptionGraceSeconds)."""

        def handler(signum: int, frame: FrameType | None) -> None:
            log.warning("SIGTERM: stopping rollout and checkpointing now")
            self.trigger()
            stop.set()

        signal.signal(signal.SIGTERM, handler)


async def until_preempted(work: Awaitable[_T], preemption: Preemption | None) -> _T:
    """Await `work`, or cancel it and raise Preempted as soon as SIGTERM arrives."""
    if preemption is None:
        return await work
    task = asyncio.ensure_future(work)
    while True:
        if preemption.event.is_set():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # how it ended does not matter
                await task
            raise Preempted("SIGTERM: the wait for rollouts was abandoned")
        done, _ = await asyncio.wait({task}, timeout=POLL_S)
        if done:
            return task.result()


def announce_state(trainer: object, after: DriverState) -> None:
    """Tell a trainer group the state after the next step, so that its rank 0 can checkpoint that step
    on SIGTERM (preemption); an in-process trainer needs nothing (this process saves on SIGTERM)."""
    announce = getattr(trainer, "announce_state", None)
    if announce is not None:
        announce(after)
