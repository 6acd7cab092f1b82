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

import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import yaml
from lockstep.api.transport_choice import TRANSPORT_KEY, TransportChoice
from lockstep.api.weightchannel import WeightChannelStatus

from lockstep_operator.resources.common import (
    LABEL_POOL_CLIENT,
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


_YAML: OrderedDict[str, str] = OrderedDict()
"""JSON text of a rendered job -> its job.yaml: every RLJob pass renders the ConfigMap, and the YAML
emitter (pure Python) was a tenth of the operator's CPU per pass; the JSON key is cheap (C)."""
YAML_CACHE_SIZE = 1024
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
"""libyaml's emitter where PyYAML was built with it (its wheels are): the same text as SafeDumper's
for these documents, about 5x faster; a new job's first rendering is then ~1 ms, not ~6."""


def _yaml(data: Mapping[str, Any]) -> str:
    return yaml.dump(dict(data), Dumper=_DUMPER, sort_keys=True)


def _job_yaml(rendered: Mapping[str, Any]) -> str:
    """The YAML of `rendered` (sorted keys), remembered for the last YAML_CACHE_SIZE renderings."""
    key = json.dumps(rendered, sort_keys=True)
    text = _YAML.get(key)
    if text is None:
        text = _YAML[key] = _yaml(rendered)
        while len(_YAML) > YAML_CACHE_SIZE:
            _YAML.popitem(last=False)
    _YAML.move_to_end(key)
    return text


def runtime_config_map(
    owner: Owner, *, job: str, rendered: Mapping[str, Any], transport: TransportChoice | None = None
) -> Manifest:
    """ConfigMap `<job>-config` holding job.yaml (the manifest the runtime roles load) and, once the
    WeightChannel chose one, `transport.json` (one apply owns both keys: the key goes away with the
    choice)."""
    data = {"job.yaml": _job_yaml(rendered)}
    if transport is not None:
        data[TRANSPORT_KEY] = transport.to_json()
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(owner, config_name(job), job_labels(job)),
        "data": data,
    }


def pool_config_map(owner: Owner, *, pool: str, spec: Mapping[str, Any]) -> Manifest:
    """ConfigMap `<pool>-config` of a standalone RolloutPool (no job renders one for it): every pod
    mounts its scope's config; an engine reads none of it, so it holds the pool's spec (pool.yaml)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(owner, config_name(pool), job_labels(pool)),
        "data": {"pool.yaml": _yaml(spec)},
    }


def progress_config_map(owner: Owner, *, job: str, pool: str | None = None) -> Manifest:
    """ConfigMap `<job>-progress`, created empty: the operator applies only metadata, so the data the
    driver patches in is never owned (or reset) by the operator's server-side apply. `pool`: the
    standalone pool the job samples on (rollout.poolRef), labelled so that a report also reaches that
    pool's reconcile (its engines' readiness follows every job's adapter)."""
    labels = job_labels(job, "driver") | ({LABEL_POOL_CLIENT: pool} if pool else {})
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata(owner, progress_name(job), labels)}


def driver_rbac(owner: Owner, *, job: str) -> list[Manifest]:
    """ServiceAccount, Role (get/patch on the one progress ConfigMap) and RoleBinding of the driver."""
    return _progress_rbac(owner, driver_name(job), job_labels(job, "driver"), job, ["get", "patch"])


SESSION_ROUTING_RULE: dict[str, list[str]] = {
    "apiGroups": ["discovery.k8s.io"],
    "resources": ["endpointslices"],
    "verbs": ["list"],
}
"""What the driver's session server needs to keep each agent session on one live engine pod: list the
EndpointSlices of the pool's router Service (lockstep.serving.membership.EndpointSliceMembers; no
watch: it lists again every few seconds). List cannot be narrowed by name, so only agent jobs get it."""


def session_routing_rbac(owner: Owner, *, job: str, agent: bool) -> list[Manifest]:
    """Role and RoleBinding `<job>-driver-sessions` (SESSION_ROUTING_RULE) for a job whose driver runs
    agents through its session server (`agent`: spec.agent.agentFunction or spec.agent.sandbox set);
    none for other jobs."""
    if not agent:
        return []
    name, labels = f"{driver_name(job)}-sessions", job_labels(job, "driver")
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata(owner, name, labels),
            "rules": [SESSION_ROUTING_RULE],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(owner, name, labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": driver_name(job), "namespace": owner.namespace}],
        },
    ]


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
