"""A failed pass made visible: the ReconcileError condition on its object and a Warning Event.

Why it exists: when a child is refused (Pod Security admission, a ResourceQuota, an RBAC verb the
operator lacks) the pass raises and the work queue retries it with backoff; without this the only
trace is the operator's log and an RLJob with an empty phase. `record_failure` writes the API's
message into condition ReconcileError of the object whose pass failed (an RLJob without a phase yet
shows Pending), only when the message changed (a retry that fails the same way writes nothing), and
records a Warning Event `ReconcileError` on it (and on its RLJob for a child); the recorder's
deduplication turns repeats into a count. The next successful pass removes the condition
(reconcile_error.without_error) and posts `Reconciled`. Called by `dispatch` for every failed pass
except a 404 (the object went away).
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from lockstep_operator.k8s.client import ApiError, KubeClient
from lockstep_operator.k8s.events import Recorder
from lockstep_operator.policy.events import RECONCILE_ERROR, Reason, warning
from lockstep_operator.policy.reconcile_error import classify
from lockstep_operator.resources.common import API_VERSION

log = logging.getLogger("lockstep_operator")
MAX_MESSAGE = 2000


def describe(err: Exception) -> tuple[str, str]:
    """(reason, message) of the condition for `err`: the API's status and words, or the exception."""
    if isinstance(err, ApiError):
        where = f"{err.method} {err.path}: " if err.method else ""
        return classify(err.status, err.message), f"{where}{err.message}"[:MAX_MESSAGE]
    return classify(None, str(err)), f"{type(err).__name__}: {err}"[:MAX_MESSAGE]


def _stamp(now: dt.datetime) -> str:
    return now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def record_failure(
    kube: KubeClient,
    kind: str,
    namespace: str,
    name: str,
    err: Exception,
    recorder: Recorder,
    *,
    now: dt.datetime,
) -> None:
    """Set ReconcileError on `kind namespace/name` for `err` and record the Warning Event. Never raises:
    a failure here (the API down, status refused) is logged; the pass's own error is what gets retried."""
    reason, message = describe(err)
    try:
        body = await kube.get(API_VERSION, kind, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        status: dict[str, Any] = body.get("status") or {}
        conditions: list[dict[str, Any]] = list(status.get("conditions") or [])
        old = next((c for c in conditions if c.get("type") == RECONCILE_ERROR), None)
        recorder.record(body, warning(Reason.RECONCILE_ERROR, message), job_too=kind != "RLJob")
        if (
            old is not None
            and old.get("status") == "True"
            and (old.get("reason"), old.get("message")) == (reason, message)
        ):
            return  # the same failure again: the status already says so
        new = {
            "type": RECONCILE_ERROR,
            "status": "True",
            "reason": reason,
            "message": message,
            "lastTransitionTime": old["lastTransitionTime"]
            if old and old.get("status") == "True"
            else _stamp(now),
            "observedGeneration": body["metadata"].get("generation"),
        }
        conditions = [c for c in conditions if c.get("type") != RECONCILE_ERROR] + [new]
        patch: dict[str, Any] = {"status": {"conditions": conditions}}
        if kind == "RLJob" and not status.get("phase"):
            patch["status"]["phase"] = "Pending"
        await kube.merge_patch(API_VERSION, kind, namespace, name, patch, subresource="status")
    except Exception as failure:  # the pass's own error is what the caller raises
        log.warning("could not record the failed pass of %s %s/%s: %s", kind, namespace, name, failure)
