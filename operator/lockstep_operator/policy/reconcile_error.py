"""The ReconcileError condition: a pass that failed, with the API server's own words, until one succeeds.

Why it exists: a reconcile that keeps failing (a child refused by Pod Security admission, a
ResourceQuota, a missing RBAC verb) used to be visible only in the operator's log. The failed pass's
object gets `ReconcileError=True` with a reason classifying the refusal and the API's message
(reconcile/errors.py writes it); the next pass of that object that succeeds removes it. The RLJob
shows its children's too, so `kubectl describe rljob` names the refused pod of its pool. Pure.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from lockstep.api.common import Condition, ConditionStatus

from lockstep_operator.policy.condition import set_condition
from lockstep_operator.policy.events import RECONCILE_ERROR


def classify(status: int | None, message: str) -> str:
    """The condition's reason for an API answer `status` with `message` (None: not an API error)."""
    text = message.lower()
    if status is None:
        return "InternalError"
    if status == 403 and "exceeded quota" in text:
        return "QuotaExceeded"
    if status in (400, 403, 422) and (
        "podsecurity" in text
        or "admission" in text
        or "denied the request" in text
        or "validatingadmissionpolicy" in text
    ):
        return "AdmissionDenied"
    if status in (401, 403):
        return "Forbidden"
    if status in (400, 422):
        return "Invalid"
    if status == 409:
        return "Conflict"
    if status == 429 or status >= 500:
        return "ApiUnavailable"
    return f"ApiError{status}"


def without_error(conditions: Sequence[Condition]) -> list[Condition]:
    """`conditions` minus ReconcileError (a pass of this object succeeded)."""
    return [c for c in conditions if c.type != RECONCILE_ERROR]


def fold_children(
    conditions: Sequence[Condition],
    children: Sequence[tuple[str, Sequence[Condition]]],
    *,
    now: dt.datetime,
    generation: int | None,
) -> list[Condition]:
    """The RLJob's conditions after a successful pass: ReconcileError from the first child that has it
    (`children`: (kind, its conditions)), else none."""
    for kind, child in children:
        failed = next(
            (c for c in child if c.type == RECONCILE_ERROR and c.status == ConditionStatus.TRUE), None
        )
        if failed is not None:
            message = f"{kind}: {failed.message}"
            return set_condition(
                conditions, RECONCILE_ERROR, True, failed.reason, message, now=now, generation=generation
            )
    return without_error(conditions)
