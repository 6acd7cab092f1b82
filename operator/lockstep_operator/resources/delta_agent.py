"""The disk-delta agent sidecar of an engine pod: its node-local copy, patched from the shared volume.

Why it exists: with `weightSync.transport: disk-delta` and a shared volume, the trainer publishes each
version once on the shared volume and every engine keeps and patches its own copy on local disk
(§7.2.4; lockstep.weights.delta_agent runs the host side, docs/weights.md "Disk-delta per host"). So
each engine pod gets a second container, `delta-agent` (the runtime image: `lockstep delta agent`), and
a node-local volume for the copy: a hostPath at `weightSync.diskDelta.path` (a directory per pod under
it, e.g. on local NVMe; it must be writable by uid 1000 and the namespace must admit hostPath) or, by
default, an emptyDir. The agent listens on the pod IP's port 30001 (the trainer ranks reach every
engine port, resources.network) and reloads the engine on the pod IP too (the engine listens there
only); a reference engine may read disk updates from the copy's volume (`--weights-root`). Pure,
golden-tested.

Who calls it: resources.engines (engine_manifest), from the pool annotation resources.children sets.
"""

from __future__ import annotations

import copy
from typing import Any

from lockstep_operator.resources.common import (
    API_KEY_ENV,
    API_KEY_ITEM,
    POD_IP_ENV,
    SHARED_MOUNT,
    Manifest,
    api_key_secret_name,
)
from lockstep_operator.resources.pods import run_dir

AGENT_PORT = 30001
"""The agent's port (lockstep.serving.membership.DELTA_AGENT_PORT)."""
LOCAL_MOUNT = "/var/lib/lockstep/delta-local"
"""Where the node-local volume is mounted in both containers; each pod's copy is a directory under it."""
EMPTY_DIR = "emptyDir"
"""The annotation value for an emptyDir copy (no weightSync.diskDelta.path)."""


def local_volume(setting: str) -> Manifest:
    """The node-local volume: a hostPath at `setting`, or an emptyDir for EMPTY_DIR."""
    if setting == EMPTY_DIR:
        return {"name": "delta-local", "emptyDir": {}}
    return {"name": "delta-local", "hostPath": {"path": setting, "type": "DirectoryOrCreate"}}


def publish_root(scope: str) -> str:
    """Where the trainer of job `scope` publishes: `delta/` under rank 0's run dir, which is `trainer/`
    under the ranks' LOCKSTEP_RUN_DIR on the shared volume (resources.pods.run_dir; `lockstep trainer
    --out`'s default), read by every agent."""
    return f"{run_dir(scope, shared=True)}/trainer/delta"


def agent_command(scope: str) -> list[str]:
    """`lockstep delta agent` for job `scope`'s publish root, this pod's copy and its engine."""
    return [
        "lockstep", "delta", "agent",
        "--root", publish_root(scope),
        "--local", f"{LOCAL_MOUNT}/$(POD_NAME)",
        "--host", f"$({POD_IP_ENV})",  # the engine too listens on the pod IP only (the agent's default)
        "--port", str(AGENT_PORT),
    ]  # fmt: skip


def with_delta_agent(pod: Manifest, *, scope: str, setting: str, image: str, reference: bool) -> Manifest:
    """`pod` (an engine pod with the shared volume) with the agent sidecar and the local volume.

    `scope`: the job whose run dir holds the publish root; `setting`: the annotation's value (a hostPath
    or EMPTY_DIR); `reference`: the engine is Lockstep's, whose disk reads are confined to roots."""
    pod = copy.deepcopy(pod)
    spec = pod["spec"]
    main = spec["containers"][0]
    spec["volumes"].append(local_volume(setting))
    main["volumeMounts"].append({"name": "delta-local", "mountPath": LOCAL_MOUNT, "readOnly": True})
    if reference:
        main["command"] = [*main["command"], "--weights-root", LOCAL_MOUNT]
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {
            "name": API_KEY_ENV,
            "valueFrom": {"secretKeyRef": {"name": api_key_secret_name(scope), "key": API_KEY_ITEM}},
        },
    ]
    spec["containers"].append(
        {
            "name": "delta-agent",
            "image": image,
            "imagePullPolicy": main.get("imagePullPolicy", "IfNotPresent"),
            "command": agent_command(scope),
            "env": env,
            "ports": [{"name": "delta-agent", "containerPort": AGENT_PORT}],
            "volumeMounts": [
                {"name": "shared", "mountPath": SHARED_MOUNT},
                {"name": "delta-local", "mountPath": LOCAL_MOUNT},
            ],
            "readinessProbe": {"httpGet": {"path": "/health", "port": AGENT_PORT}, "periodSeconds": 10},
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }
    )
    return pod
