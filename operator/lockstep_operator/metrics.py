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
"""result: ok | error | gone."""
KINDS = ("RLJob", "RolloutPool", "TrainerGroup", "WeightChannel")
for _kind in KINDS:  # at 0 from the start: "no error yet" is a series the error alert can select
    for _result in ("ok", "error"):
        RECONCILES.labels(_kind, _result)
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
    "lockstep_operator_api_requests_total",
    "Requests to the Kubernetes API by the reconciles",
    ["verb", "resource"],
)
"""verb: the HTTP method (GET, PATCH, POST, DELETE); resource: the plural (and subresource), e.g. pods/status."""
API_REQUEST_WAIT = Histogram(
    "lockstep_operator_api_request_wait_seconds",
    "Seconds a request of the reconciles waited for a slot of the client's gate, by priority",
    ["priority"],
    buckets=(0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
"""priority: urgent | other (lockstep_operator.policy.request_priority; k8s/gate.py)."""
EVENTS = Counter(
    "lockstep_operator_events_total",
    "Kubernetes Events posted (type Repeat: a count raised)",
    ["type", "reason"],
)
EVENTS_DROPPED = Counter(
    "lockstep_operator_events_dropped_total", "Events dropped by the per-object rate limit", ["reason"]
)
EVENTS_FAILED = Counter(
    "lockstep_operator_events_failed_total", "Events the API server refused or did not answer"
)
RETRIES = Counter(
    "lockstep_operator_reconcile_retries_total", "Failed passes scheduled again after backoff", ["kind"]
)
RATE_LIMITED_SECONDS = Counter(
    "lockstep_operator_rate_limited_seconds_total", "Seconds passes waited for the global token bucket"
)
