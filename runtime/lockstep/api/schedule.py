"""spec.schedule: how generation and training interleave, how long the job runs, when it saves and
evaluates, and the grace it gets on SIGTERM.

Why it exists: the loop's shape is one section of an RLJob, read by both loops (sync and fully-async)
and by the operator (the pods' termination grace); it is declared once here.

Who uses it: lockstep.api.rljob (RLJobSpec.schedule), lockstep.api.rules, lockstep.config.driver,
the operator.
"""

from __future__ import annotations

import enum

from pydantic import Field

from lockstep.api.common import ApiModel


class ScheduleMode(enum.StrEnum):
    """How generation and training interleave."""

    SYNC = "sync"
    FULLY_ASYNC = "fully-async"


class ScheduleSpec(ApiModel):
    """The loop: how generation and training overlap, how long, and when to save and evaluate."""

    mode: ScheduleMode = ScheduleMode.SYNC
    """`sync` (generate a batch, train, update) or `fully-async` (a persistent producer fills a
    bounded buffer while the trainer consumes it; needs separate GPUs)."""
    colocate: bool = False
    """Engines and trainer share GPUs and take turns (weights offloaded in between)."""
    max_weight_staleness: int | None = Field(default=None, ge=0, le=1000000)
    """Drop groups whose oldest token lags the current version by more than this (fully-async only);
    unset keeps every group (the bounded queue still applies back-pressure)."""
    steps: int = Field(default=100, ge=1, le=100000000)
    """Optimizer steps to run."""
    save_interval: int | None = Field(default=None, ge=1, le=100000000)
    """Save a checkpoint every this many steps; unset saves only at the end."""
    eval_interval: int | None = Field(default=None, ge=1, le=100000000)
    """Evaluate on data.evalPrompts every this many steps; unset never evaluates."""
    eval_temperature: float = Field(default=0.0, ge=0.0, le=10.0)
    """Sampling temperature of evaluation; 0 is greedy decoding."""
    buffer_groups: int | None = Field(default=None, ge=1, le=1048576)
    """Capacity in groups of the fully-async buffer between rollout and trainer; unset is
    2 x algorithm.batchSize."""
    preemption_grace_seconds: int = Field(default=120, ge=10, le=3600)
    """Seconds the driver and the trainer ranks get after SIGTERM (a pod deleted, a node drained, a
    preemption notice) to reach a safe point and write a checkpoint: the operator sets it as their
    pods' terminationGracePeriodSeconds, and the processes stop rollout at once and save within it
    (docs/fully-async.md, "Preemption"). Cloud GPUs give 30-120 s of notice."""
