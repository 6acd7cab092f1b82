"""Reconcile functions, one module per kind: ordered idempotent steps from observed state to desired.

Each `reconcile_*` fetches its object, returns early when it is being deleted (owner references let
the garbage collector remove children), server-side applies the children, reads what it observes,
computes the status with the pure functions of `status`, and writes it once, only if it changed.
Called by `lockstep_operator.handlers` (kopf events, child events and the periodic re-check).
"""
