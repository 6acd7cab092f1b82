"""The TrainerGroup's conditions, one named pure function each.

UpToDate (False, SpecChanged, while the gang restarts for a spec change; True after, keeping reason
SpecChanged as the record of that restart, Current when there never was one), Available (every rank
pod ready), Degraded (ranks missing after a gang restart), Failed (the restart limit is exhausted).
"""

from __future__ import annotations

from lockstep.api.common import Condition, ConditionStatus

from lockstep_operator.policy.condition import Update


def up_to_date(before: Condition | None, rolling: str | None) -> Update | None:
    """`rolling`: the pod-template hash the gang restarts to, None when every rank runs the current
    one; None (keep the condition as it is) once it is True and nothing rolls."""
    if rolling is not None:
        message = f"spec changed: restarting every rank with pod template {rolling} (not counted against the restart limit)"
        return Update("UpToDate", False, "SpecChanged", message)
    if before is not None and before.status == ConditionStatus.TRUE:
        return None
    if before is not None and before.reason == "SpecChanged":
        return Update(
            "UpToDate",
            True,
            "SpecChanged",
            "every rank restarted for a spec change (not counted in restarts)",
        )
    return Update("UpToDate", True, "Current", "every rank runs the current pod template")


def available(ready_pods: int, nodes: int) -> Update:
    """True when every rank pod is ready."""
    return Update("Available", ready_pods == nodes, "ReadyRanks", f"{ready_pods}/{nodes} rank pods ready")


def degraded(ready_pods: int, nodes: int, restarts: int) -> Update:
    """True while ranks are missing after at least one gang restart."""
    if restarts == 0:
        return Update("Degraded", False, "Healthy", "")
    return Update("Degraded", ready_pods < nodes, "GangRestart", f"gang restarts: {restarts}")


def failed(message: str | None) -> Update:
    """True with `message` (the failed rank and the limit) once the restart limit is exhausted."""
    if message is None:
        return Update("Failed", False, "NotFailed", "")
    return Update("Failed", True, "GangRestartLimitExceeded", message)
