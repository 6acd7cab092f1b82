"""Prometheus metrics of the operator: reconciles, their latency and errors, per kind.

Why it exists: an operator that silently stops reconciling is the worst failure; these series make
it visible (alert on a rising error rate or a flat reconcile count). Updated by
lockstep_operator.handlers around every reconcile; served on settings.metrics_port by __main__.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "lockstep_operator_reconciles_total", "Reconcile passes, by kind and result", ["kind", "result"]
)
"""result: ok | error."""
RECONCILE_SECONDS = Histogram(
    "lockstep_operator_reconcile_seconds",
    "Duration of one reconcile pass, by kind",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
ERRORS = Counter(
    "lockstep_operator_reconcile_errors_total",
    "Reconcile passes that raised, by kind and exception",
    ["kind", "error"],
)
QUEUED = Gauge("lockstep_operator_reconciles_in_flight", "Objects with a reconcile running or pending")
API_REQUESTS = Counter(
    "lockstep_operator_api_requests_total", "Requests to the Kubernetes API by the reconciles", ["verb"]
)
"""verb: the HTTP method (GET, PATCH, POST, DELETE)."""
