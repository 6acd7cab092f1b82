"""ConfigMaps and the driver's narrow RBAC: the rendered runtime config and the progress channel.

Why it exists: every pod reads the same rendered runtime config (the RLJob spec as YAML, mounted at
/etc/lockstep/job.yaml). Once the WeightChannel has chosen a transport, the same ConfigMap carries it
under `transport.json` (lockstep.api.transport_choice): the ranks' rank 0 resolves
spec.weightSync.transport `auto` from it. The key reaches running pods through the kubelet's refresh
of the mounted ConfigMap (a directory mount, never subPath) and is not part of any pod-template hash
(that hashes the spec: lockstep_operator.reconcile.rljob.run_config_hash), so writing it restarts
nothing. The driver reports progress by patching exactly one ConfigMap,
`<job>-progress`, which the operator folds into RLJob status. The driver's ServiceAccount may only
get/patch that ConfigMap by resourceName: pods get no broad RBAC. Called by the RLJob reconcile.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml
from lockstep.api.transport_choice import TRANSPORT_KEY, TransportChoice
from lockstep.api.weightchannel import WeightChannelStatus

from lockstep_operator.resources.common import (
    Manifest,
    Owner,
    config_name,
    driver_name,
    job_labels,
    metadata,
    progress_name,
    trainer_name,
)

DEFAULT_REASON = "chosen by the WeightChannel"
"""The reason written when the channel's status has a transport but no reason."""


def transport_choice(channel: WeightChannelStatus | None) -> TransportChoice | None:
    """The WeightChannel's choice as the ranks read it (pure); None while the channel has none."""
    if channel is None or channel.transport is None or channel.transport.value == "auto":
        return None
    return TransportChoice(
        transport=channel.transport.value,
        reason=channel.reason or DEFAULT_REASON,
        observed_generation=channel.observed_generation,
    )


def runtime_config_map(
    owner: Owner, *, job: str, rendered: Mapping[str, Any], transport: TransportChoice | None = None
) -> Manifest:
    """ConfigMap `<job>-config` holding job.yaml (the manifest the runtime roles load) and, once the
    WeightChannel chose one, `transport.json` (one apply owns both keys: the key goes away with the
    choice)."""
    data = {"job.yaml": yaml.safe_dump(dict(rendered), sort_keys=True)}
    if transport is not None:
        data[TRANSPORT_KEY] = transport.to_json()
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(owner, config_name(job), job_labels(job)),
        "data": data,
    }


def progress_config_map(owner: Owner, *, job: str) -> Manifest:
    """ConfigMap `<job>-progress`, created empty: the operator applies only metadata, so the data the
    driver patches in is never owned (or reset) by the operator's server-side apply."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(owner, progress_name(job), job_labels(job, "driver")),
    }


def driver_rbac(owner: Owner, *, job: str) -> list[Manifest]:
    """ServiceAccount, Role (get/patch on the one progress ConfigMap) and RoleBinding of the driver."""
    return _progress_rbac(owner, driver_name(job), job_labels(job, "driver"), job, ["get", "patch"])


def trainer_rbac(owner: Owner, *, job: str) -> list[Manifest]:
    """ServiceAccount, Role (patch on the one progress ConfigMap) and RoleBinding of the trainer ranks,
    which write there only when they cannot start (their own `rank-<r>.json` key)."""
    return _progress_rbac(owner, trainer_name(job), job_labels(job, "trainer"), job, ["patch"])


def _progress_rbac(
    owner: Owner, name: str, labels: dict[str, str], job: str, verbs: list[str]
) -> list[Manifest]:
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata(owner, name, labels)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata(owner, name, labels),
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["configmaps"],
                    "resourceNames": [progress_name(job)],
                    "verbs": verbs,
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(owner, name, labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        },
    ]
