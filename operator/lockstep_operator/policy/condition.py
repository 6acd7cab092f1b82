"""Condition updates and how they fold into a status's condition list (metav1.Condition semantics).

Why it exists: every condition of every kind is a named policy function returning an `Update`; the
status functions fold a list of updates into the previous conditions with `apply`, so
lastTransitionTime moves only when a condition's status changes, in one place.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lockstep.api.common import Condition, ConditionStatus


@dataclass(frozen=True, slots=True)
class Update:
    """One condition as a policy decided it."""

    type: str
    """Condition type (Admitted, Failed, ...)."""
    status: bool | None
    """True, False, or None for Unknown."""
    reason: str
    """CamelCase reason."""
    message: str = ""
    """Human-readable detail."""


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    *,
    now: dt.datetime,
    generation: int | None,
) -> list[Condition]:
    """Return `conditions` with `type_` set; lastTransitionTime moves only when the status changes."""
    value = {True: ConditionStatus.TRUE, False: ConditionStatus.FALSE, None: ConditionStatus.UNKNOWN}[status]
    old = next((c for c in conditions if c.type == type_), None)
    updated = Condition(
        type=type_,
        status=value,
        reason=reason,
        message=message[:32768],
        last_transition_time=old.last_transition_time if old is not None and old.status == value else now,
        observed_generation=generation,
    )
    if old is None:
        return [*conditions, updated]
    return [updated if c.type == type_ else c for c in conditions]


def apply(
    conditions: Sequence[Condition], updates: Iterable[Update], *, now: dt.datetime, generation: int | None
) -> list[Condition]:
    """Fold `updates` into `conditions` in order (set_condition for each)."""
    out = list(conditions)
    for u in updates:
        out = set_condition(out, u.type, u.status, u.reason, u.message, now=now, generation=generation)
    return out


def condition(conditions: Sequence[Condition], type_: str) -> Condition | None:
    """The condition of type `type_`, if any."""
    return next((c for c in conditions if c.type == type_), None)


def is_true(conditions: Sequence[Condition], type_: str) -> bool:
    """Whether the condition `type_` exists with status True."""
    cond = condition(conditions, type_)
    return cond is not None and cond.status == ConditionStatus.TRUE
