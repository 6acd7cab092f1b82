"""The WeightChannel's conditions, one named pure function each.

Ready (a transport is chosen), RequestedTransportFeasible (an explicit spec.weightSync.transport can
be honoured, else why not), PreflightPassed (the driver's weight-equality result, once reported),
Degraded (the last update failed on the chosen transport and a fallback delivered it).
"""

from __future__ import annotations

from collections.abc import Sequence

from lockstep_operator.policy.condition import Update


def ready(chosen: bool, reason: str | None) -> Update:
    """True once a transport is chosen; the topology decision's reason either way."""
    return Update("Ready", chosen, "TransportChosen" if chosen else "NoTransport", reason or "")


def requested_transport_feasible(rejected: str | None) -> Update:
    """False with why the requested transport cannot be used (the automatic choice is used instead)."""
    if rejected:
        return Update("RequestedTransportFeasible", False, "Infeasible", rejected)
    return Update("RequestedTransportFeasible", True, "Feasible", "")


def preflight_passed(passed: bool, mismatched: Sequence[str]) -> Update:
    """The pre-flight result as the driver reported it, naming the tensors that differ."""
    if passed:
        return Update("PreflightPassed", True, "Equal", "every tensor equal after the initial sync")
    return Update("PreflightPassed", False, "Mismatch", f"tensors that differ: {', '.join(mismatched)}")


def degraded(transport: str | None, fallback: str | None, version: int | None, count: int | None) -> Update:
    """True while the last update was delivered by a fallback transport, naming both and the version."""
    if not fallback:
        return Update("Degraded", False, "Healthy", "")
    return Update(
        "Degraded",
        True,
        "TransportFellBack",
        f"the update to version {version} failed on {transport or 'the chosen transport'} and {fallback} "
        f"delivered it whole to every engine ({count or 1} fallback(s) so far; the trainer's log has the error)",
    )
