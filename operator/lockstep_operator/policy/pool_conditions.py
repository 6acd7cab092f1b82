"""The RolloutPool's conditions, one named pure function each.

Available (at least one engine ready, and the pool's minimum), MinAvailableBreached (fewer ready
engines than min_available), WeightsSynced (no engine behind the current weight version; Unknown
before the first version is published).
"""

from __future__ import annotations

from collections.abc import Sequence

from lockstep_operator.policy.condition import Update


def available(ready: int, engines: int, min_available: int) -> Update:
    """True when at least max(min_available, 1) engines are ready (False for an empty pool)."""
    need = max(min_available, 1) if engines or min_available else 0
    return Update(
        "Available", ready >= need and need > 0, "ReadyReplicas", f"{ready}/{engines} engines ready"
    )


def min_available_breached(ready: int, min_available: int) -> Update:
    """True while fewer than min_available engines are ready."""
    return Update(
        "MinAvailableBreached",
        ready < min_available,
        "ReadyReplicas",
        f"{ready} ready, minimum {min_available}",
    )


def weights_synced(current_version: int | None, lagging: Sequence[str]) -> Update:
    """False naming the engines behind `current_version`; Unknown before any version is published."""
    if current_version is None:
        return Update("WeightsSynced", None, "NoVersionYet", "")
    message = f"engines behind version {current_version}: {', '.join(lagging)}" if lagging else ""
    return Update("WeightsSynced", not lagging, "Versions", message)
