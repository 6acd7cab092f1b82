"""Which stale engines to replace now when a pool's spec changed (pure policy, no I/O).

Why it exists: pods are immutable in most fields, so an edited image, engine argument or resource
request only reaches the engines by replacing them. GPUs are usually fully booked, so the roll is
surge-free: one stale engine is deleted, its replacement (same name, new pod template) must be Ready,
then the next one goes. A stale engine that is not Ready serves nothing and is replaced at once.
The pool never drops below its minimum of ready engines because of the roll: a Ready stale engine
is deleted only while every desired engine is Ready and one fewer still meets the minimum; a pool
without headroom above its minimum (replicas == minimum) has one engine down at a time (otherwise it
could never roll), which MinAvailableBreached shows while it lasts.

Who calls it: lockstep_operator.reconcile.rolloutpool, each pass, with what it observed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineState:
    """One engine replica as the pool reconcile observed it."""

    name: str
    """Pod name."""
    index: int
    """Replica index (the pod's rl.lockstep.dev/replica label)."""
    stale: bool
    """Its pod-template hash differs from a fresh rendering (the spec changed since it was created)."""
    ready: bool
    """Ready as the pool counts it (pod Ready and holding the current weight version)."""
    terminating: bool
    """Deletion already requested."""


def engines_to_roll(engines: Sequence[EngineState], *, desired: int, min_ready: int) -> list[str]:
    """Names of the stale engines to delete now (their replacements are created once they are gone).

    `desired`: the pool's replica count now; `min_ready`: ready engines the pool must keep.
    """
    live = [e for e in engines if not e.terminating and 0 <= e.index < desired]
    out = [e.name for e in live if e.stale and not e.ready]  # down already: nothing to lose
    ready = [e for e in live if e.ready]
    floor = min(min_ready, desired - 1)
    in_flight = len(ready) < desired or any(e.terminating for e in engines)
    if out or in_flight or len(ready) - 1 < floor:
        return out
    stale_ready = sorted((e for e in ready if e.stale), key=lambda e: e.index)
    return [stale_ready[0].name] if stale_ready else []
