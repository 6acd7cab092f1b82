"""The unload pod of a standalone pool: `lockstep unload-adapter NAME --engine URL...` against its engines.

Why a pod and not the operator itself: the pool's engines admit only the pods of their clients
(NetworkPolicy: label pool-client=<pool>) and authenticate every mutating route with the pool's API
key, which the operator never reads back (it has no right to read Secrets). The unload pod carries
that label and gets the key from the pool's Secret like the jobs' drivers do, so cleanup needs no
new privilege. It runs the runtime image, requests little, never restarts (the operator creates a
new one if it fails) and is owned by the pool.

Who calls it: lockstep_operator.reconcile.adapter_gc. Pure.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from lockstep_operator.resources.annotations import Annotation
from lockstep_operator.resources.common import (
    ENGINE_PORT,
    LABEL_POOL_CLIENT,
    LABEL_ROLE,
    Manifest,
    Owner,
    job_labels,
    metadata,
)
from lockstep_operator.resources.pods import POD_SECURITY, api_key_env

ROLE = "adapter-gc"
"""The role label of unload pods (not an engine: the pool's Services and engine list never select it)."""


def unload_pod_name(pool: str, adapter: str) -> str:
    """`<pool>-unload-<10 hex of the adapter name>` (adapter names may be longer than a name allows)."""
    return f"{pool}-unload-{hashlib.sha256(adapter.encode()).hexdigest()[:10]}"


def unload_labels(pool: str) -> dict[str, str]:
    labels = job_labels(pool)
    labels.update({"app.kubernetes.io/component": ROLE, LABEL_ROLE: ROLE, LABEL_POOL_CLIENT: pool})
    return labels


def engine_url(pod: Mapping[str, Any]) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    return f"http://{ip}:{ENGINE_PORT}" if ip else None


def unload_pod(
    owner: Owner, *, pool: str, adapter: str, engines: Sequence[Mapping[str, Any]], image: str
) -> Manifest:
    """The pod unloading `adapter`'s versions from `engines` (live engine pods with an IP). It is placed
    as the first engine is (its node selector, node affinity and tolerations: the same architecture)."""
    urls = [u for u in (engine_url(p) for p in engines) if u]
    command = ["lockstep", "unload-adapter", adapter]
    for url in sorted(urls):
        command += ["--engine", url]
    template = (engines[0].get("spec") or {}) if engines else {}
    spec: Manifest = {
        "restartPolicy": "Never",
        # Its command is PID 1 without a SIGTERM handler, so SIGTERM does nothing and a deleted pod
        # would run out the default 30 s; a job re-created under the adapter's name waits for its
        # removal (policy.pool_ref). Killing it mid-way loses nothing: the unloads are idempotent.
        "terminationGracePeriodSeconds": 1,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": POD_SECURITY,
        "containers": [
            {
                "name": "main",
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                "command": command,
                "env": [api_key_env(pool)],
                "resources": {"requests": {"cpu": "10m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
            }
        ],
    }
    for key in ("nodeSelector", "tolerations", "imagePullSecrets"):
        if template.get(key):
            spec[key] = template[key]
    node_affinity = (template.get("affinity") or {}).get("nodeAffinity")
    if node_affinity:  # not the engines' pod (anti-)affinity: this pod is no engine
        spec["affinity"] = {"nodeAffinity": node_affinity}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata(
            owner, unload_pod_name(pool, adapter), unload_labels(pool), {Annotation.ADAPTER.value: adapter}
        ),
        "spec": spec,
    }
