"""The job's shared API key: one random Secret per RLJob, owned by it.

Why it exists: engines, session server and trainer command server all change state the job depends
on, so each requires the same bearer key (docs/security.md, "One key per job"). The key is made here once (`secrets`, 256 bits)
and never rendered into a pod spec, a log or a status: pods read it through a secretKeyRef
(resources.pods.api_key_env). Rendering is pure given the key; the RLJob reconcile creates the
Secret only when it is missing (an apply would rotate it under running pods) and never reads it back.
"""

from __future__ import annotations

import secrets

from lockstep_operator.resources.common import (
    API_KEY_ITEM,
    Manifest,
    Owner,
    api_key_secret_name,
    job_labels,
    metadata,
)


def new_api_key() -> str:
    """A fresh random key (URL-safe, 43 characters)."""
    return secrets.token_urlsafe(32)


def api_key_secret(owner: Owner, *, job: str, key: str) -> Manifest:
    """Secret `<job>-api-key` with item `api-key` = `key`, owned by the job (deleted with it)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata(owner, api_key_secret_name(job), job_labels(job)),
        "stringData": {API_KEY_ITEM: key},
    }
