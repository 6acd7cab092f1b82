"""Autoscaling policy: how many rollout replicas a RolloutPool should run, from the async buffer's queue.

Why it exists: in fully-async training the driver keeps a buffer of finished groups between the rollout
engines (producers) and the trainer (consumer). The queue length says who is the bottleneck:
- the queue sits near zero for a whole window: the trainer starves -> one more replica;
- the queue is pinned at its capacity for a whole window: rollouts outrun the trainer (and grow
  staleness) -> one replica fewer.
Changes happen only at step boundaries (a replica joining mid-step would miss the current weight
version), never more often than the cooldown, and always within [min_replicas, max_replicas].

Who calls it: `lockstep_operator.reconcile.rolloutpool` with the queue samples the driver reported
through the progress channel; it writes the result to the pool's spec.replicas (so HPA/KEDA driving
/scale instead is equally valid: then the policy is switched off in the spec). Pure: the clock is
passed in as `now`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QueueSample:
    """One observation of the async buffer, as reported by the driver."""

    at: float
    """When it was observed (seconds, the same clock as `now`)."""
    step: int
    """The trainer step at that moment."""
    queue_size: int
    """Finished groups waiting in the buffer."""
    capacity: int
    """The buffer's capacity in groups."""


@dataclass(frozen=True, slots=True)
class ScalePolicy:
    """Bounds and timing, from the RolloutPool spec."""

    min_replicas: int
    """Never fewer replicas than this."""
    max_replicas: int
    """Never more replicas than this."""
    window_s: float = 120.0
    """How long the queue must stay near zero (or at capacity) before acting."""
    cooldown_s: float = 300.0
    """Minimum time between two changes."""
    low_fraction: float = 0.05
    """Queue <= low_fraction * capacity counts as near zero."""
    high_fraction: float = 0.95
    """Queue >= high_fraction * capacity counts as pinned at capacity."""


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """The policy's answer."""

    replicas: int
    """The desired number of replicas (equal to the current one when nothing changes)."""
    reason: str
    """One line for status and events."""


def decide_replicas(
    *,
    current: int,
    policy: ScalePolicy,
    samples: Sequence[QueueSample],
    last_scaled_at: float | None,
    last_scaled_step: int | None,
    now: float,
) -> ScaleDecision:
    """Return the replica count the pool should have now (pure; `samples` in any order)."""
    bounded = min(max(current, policy.min_replicas), policy.max_replicas)
    if bounded != current:
        return ScaleDecision(
            bounded, f"replicas {current} outside bounds [{policy.min_replicas}, {policy.max_replicas}]"
        )
    if last_scaled_at is not None and now - last_scaled_at < policy.cooldown_s:
        return ScaleDecision(current, f"cooldown: {policy.cooldown_s - (now - last_scaled_at):.0f}s left")
    ordered = sorted(samples, key=lambda s: s.at)
    window = [s for s in ordered if s.at >= now - policy.window_s]
    if not window or ordered[0].at > now - policy.window_s:
        return ScaleDecision(current, "not enough queue history for a full window")
    latest = window[-1]
    if last_scaled_step is not None and latest.step <= last_scaled_step:
        return ScaleDecision(current, "waiting for the next step boundary")
    if all(s.queue_size <= policy.low_fraction * s.capacity for s in window):
        if current < policy.max_replicas:
            return ScaleDecision(
                current + 1, f"queue near zero for {policy.window_s:.0f}s: trainer is starving"
            )
        return ScaleDecision(current, "queue near zero but already at max_replicas")
    if all(s.queue_size >= policy.high_fraction * s.capacity for s in window):
        if current > policy.min_replicas:
            return ScaleDecision(
                current - 1, f"queue at capacity for {policy.window_s:.0f}s: rollouts outrun training"
            )
        return ScaleDecision(current, "queue at capacity but already at min_replicas")
    return ScaleDecision(current, "queue within bounds")
