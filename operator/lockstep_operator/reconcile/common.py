"""Helpers shared by the reconciles: the previous status parsed, the write-once status patch.

Why it exists: every reconcile reads its status and writes it the same way (only when it changed,
never kopf bookkeeping), so an unchanged pass costs no write and no watch event.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from lockstep_operator.k8s.client import ApiError, KubeClient
from lockstep_operator.resources import secrets
from lockstep_operator.resources.annotations import annotations_of
from lockstep_operator.resources.common import API_VERSION, Owner
from lockstep_operator.resources.network import baseline_network_policy

__all__ = ["Wire", "annotations_of", "ensure_baseline", "previous_status", "write_status"]

S = TypeVar("S", bound=BaseModel)


class Wire(Protocol):
    """A lockstep.api status model (it has `wire()`)."""

    def wire(self) -> dict[str, Any]: ...


def previous_status(body: Mapping[str, Any], model: type[S]) -> S | None:
    """The object's current status parsed, or None when absent or unreadable (then it is rewritten)."""
    raw = body.get("status")
    if not raw:
        return None
    try:
        return model.model_validate(raw)
    except ValidationError:
        return None


async def write_status(kube: KubeClient, body: Mapping[str, Any], previous: Wire | None, new: Wire) -> bool:
    """Patch /status with `new` when it differs from `previous` (the parsed current status).

    Both sides go through the same model, so formatting differences (timestamps) never cause a
    write. Keys the object holds that `new` lacks are cleared. Returns True when written.
    """
    wire = new.wire()
    if previous is not None and previous.wire() == wire:
        return False
    old = body.get("status") or {}
    patch = {"status": {**{k: None for k in old if k not in wire}, **wire}}
    meta = body["metadata"]
    await kube.merge_patch(
        API_VERSION, body["kind"], meta["namespace"], meta["name"], patch, subresource="status"
    )
    return True


async def ensure_baseline(kube: KubeClient, namespace: str) -> None:
    """Apply the namespace's baseline NetworkPolicy before a pass creates pods (resources.network): a
    job's pods are then closed, not open, until their own policies follow them. Ahead of the other
    requests (the pods wait for it), once per namespace and apply refresh period: a burst's passes
    share one request, and a deleted baseline comes back with the first pass creating pods after it."""
    await kube.apply(baseline_network_policy(namespace), cache=True, first=True)


_KEYED: set[str] = set()
"""UIDs of jobs whose API-key Secret this process created or found (no create call per pass)."""


async def ensure_api_key(kube: KubeClient, owner: Owner, name: str) -> None:
    """Create Secret `<name>-api-key` (owned by `owner`: a job, or a standalone pool) once. Create,
    never apply: an apply would rotate the key under running pods. The operator needs only `create`
    on secrets (a 409 means it exists); it never reads a Secret back, and the key appears in no log."""
    if owner.uid in _KEYED:
        return
    try:
        await kube.create(secrets.api_key_secret(owner, job=name, key=secrets.new_api_key()))
    except ApiError as err:
        if err.status != 409:
            raise
    _KEYED.add(owner.uid)
