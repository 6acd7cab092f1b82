"""Names, labels and owner references shared by every child manifest.

Why it exists: children are found again by labels and names (level-triggered reconciles list them
each time), so the naming scheme must be defined once. Labels follow app.kubernetes.io/* plus our own
rl.lockstep.dev/{job,role,pool,rank,replica}. Called by every builder in this package.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from lockstep.api.auth import API_KEY_ENV as API_KEY_ENV  # every pod reads the job's key from it
from lockstep.api.progress import progress_config_map_name

GROUP = "rl.lockstep.dev"
API_VERSION = f"{GROUP}/v1alpha1"
LABEL_JOB = f"{GROUP}/job"
LABEL_ROLE = f"{GROUP}/role"
LABEL_POOL = f"{GROUP}/pool"
LABEL_TRAINER = f"{GROUP}/trainer"
LABEL_RANK = f"{GROUP}/rank"
LABEL_REPLICA = f"{GROUP}/replica"
LABEL_POOL_CLIENT = f"{GROUP}/pool-client"
"""On the driver and trainer pods of a job that uses a standalone pool (rollout.poolRef): the pool's
name. The pool's engine NetworkPolicy admits the pods with it."""

TEACHER_CLIENT_PREFIX = f"teacher-client.{GROUP}"
"""Prefix of the label `teacher-client.rl.lockstep.dev/<pool>: "true"` on the driver pod of a job that
reads a standalone teacher pool (algorithm.opd.teachers[].poolRef): one key per pool, so a driver can
read several. The teacher pool's engine NetworkPolicy admits the pods with it, on the HTTP port only."""


def clone(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of a JSON manifest (dicts, lists, scalars), by pickle: several times faster than
    copy.deepcopy, which was a large share of the operator's CPU (the store's reads, rendered pods)."""
    return pickle.loads(pickle.dumps(dict(manifest), pickle.HIGHEST_PROTOCOL))  # type: ignore[no-any-return]


def teacher_client_label(pool: str) -> str:
    """The label key a standalone teacher pool's NetworkPolicy admits (pure)."""
    return f"{TEACHER_CLIENT_PREFIX}/{pool}"


Role = Literal["driver", "engine", "trainer"]
Manifest = dict[str, Any]

CONFIG_MOUNT = "/etc/lockstep"
"""Where the rendered runtime config (job.yaml) is mounted in every pod."""
CONFIG_FILE = "job.yaml"
SHARED_MOUNT = "/shared"
"""Where the shared ReadWriteMany volume (checkpoints, disk-delta versions) is mounted."""
RUN_MOUNT = "/var/lib/lockstep/run"
"""A rank pod's run dir (an emptyDir) when the job names no shared volume."""
ENGINE_PORT = 30000
"""SGLang's default HTTP port; the router Service targets it."""
RENDEZVOUS_PORT = 29500
"""torch.distributed rendezvous port of rank 0 (MASTER_PORT)."""
WEIGHTS_CURRENT = f"{GROUP}/weights-current"
"""Readiness gate of engine pods: the pod condition the pool reconcile sets True once the driver reports
the engine at the current weight version (the kubelet counts a pod Ready only with it True)."""
CONTROL_PORT = 29600
"""Trainer rank 0's control endpoint (`lockstep trainer --serve`): the driver sends the RL steps there."""
METRICS_PORT = 9400
"""Every job pod's Prometheus endpoint (port name `metrics`, $LOCKSTEP_METRICS_PORT): the driver's step
metrics, the engine's and the trainer's series; what manifests/monitoring's PodMonitors scrape."""


@dataclass(frozen=True, slots=True)
class Owner:
    """The object that owns a child (deleting it garbage-collects the child)."""

    api_version: str
    """apiVersion of the owner."""
    kind: str
    """kind of the owner."""
    name: str
    """metadata.name of the owner."""
    uid: str
    """metadata.uid of the owner (owner references need it)."""
    namespace: str
    """Namespace of the owner and of every child."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """The owner's labels (copied onto children, below our own labels)."""

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> Owner:
        """From an object as kopf or the API server gives it."""
        meta = body["metadata"]
        return cls(
            api_version=str(body.get("apiVersion", API_VERSION)),
            kind=str(body["kind"]),
            name=str(meta["name"]),
            uid=str(meta["uid"]),
            namespace=str(meta["namespace"]),
            labels=dict(meta.get("labels") or {}),
        )

    def reference(self) -> Manifest:
        """The ownerReference: controller, blocking the owner's foreground deletion."""
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def job_labels(job: str, role: Role | None = None, **extra: str) -> dict[str, str]:
    """The labels of a child of RLJob `job`; `extra` keys are rl.lockstep.dev/<key>."""
    labels = {
        "app.kubernetes.io/name": "lockstep",
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/part-of": "lockstep",
        "app.kubernetes.io/managed-by": "lockstep-operator",
        LABEL_JOB: job,
    }
    if role:
        labels["app.kubernetes.io/component"] = role
        labels[LABEL_ROLE] = role
    labels.update({f"{GROUP}/{k}": v for k, v in extra.items()})
    return labels


def metadata(
    owner: Owner, name: str, labels: Mapping[str, str], annotations: Mapping[str, str] | None = None
) -> Manifest:
    """metadata of a child: namespace and owner reference of the owner, inherited plus own labels."""
    user_labels = {k: v for k, v in owner.labels.items() if not k.startswith(GROUP)}
    meta: Manifest = {
        "name": name,
        "namespace": owner.namespace,
        "labels": {**user_labels, **labels},
        "ownerReferences": [owner.reference()],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def selector(labels: Mapping[str, str]) -> str:
    """A label selector string (for /scale's labelSelectorPath and list calls), keys sorted."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


# Names of the children of RLJob `job` (DNS-1123; the API caps job names so the suffixes fit).
def config_name(job: str) -> str:
    """ConfigMap with the rendered runtime config."""
    return f"{job}-config"


def progress_name(job: str) -> str:
    """ConfigMap the driver patches with its progress (the only object it may write)."""
    return progress_config_map_name(job)


def driver_name(job: str) -> str:
    """The driver pod, its ServiceAccount, Role and RoleBinding."""
    return f"{job}-driver"


def pool_name(job: str) -> str:
    """The RolloutPool of the job."""
    return f"{job}-rollout"


def trainer_name(job: str) -> str:
    """The TrainerGroup of the job (and its headless Service: the rank pods' subdomain)."""
    return f"{job}-trainer"


def channel_name(job: str) -> str:
    """The WeightChannel of the job."""
    return f"{job}-weights"


def router_name(pool: str) -> str:
    """The Service in front of a pool's engines."""
    return f"{pool}-router"


def gang_name(job: str) -> str:
    """The pod group (Volcano / scheduler-plugins PodGroup, Kueue pod-group name) of the job."""
    return f"{job}-gang"


def router_url(job: str) -> str:
    """The URL of the job's engine router (same namespace): the driver and the trainer ranks use it."""
    return pool_router_url(pool_name(job))


def pool_router_url(pool: str) -> str:
    """The URL of pool `pool`'s router Service (same namespace)."""
    return f"http://{router_name(pool)}:{ENGINE_PORT}"


def used_pool(job: str, shared: str | None) -> str:
    """The RolloutPool job `job` samples on: the standalone pool it references, else its own (pure)."""
    return shared or pool_name(job)


def pool_scope(job: str | None, pool: str) -> str:
    """Whose name a pool's engines carry in their job label, API-key Secret and run dir: the job that
    owns the pool, or for a standalone pool (no job) the pool itself (pure)."""
    return job or pool


def trainer_url(trainer: str, namespace: str) -> str:
    """Trainer rank 0's control endpoint through the headless Service (stable per-pod DNS)."""
    return f"http://{trainer}-0.{trainer}.{namespace}.svc:{CONTROL_PORT}"


def network_policy_name(trainer: str) -> str:
    """The NetworkPolicy guarding a trainer group's rank pods (named like the group)."""
    return trainer


def engines_service_name(pool: str) -> str:
    """The headless Service listing every engine of a pool, ready or not (the driver asks each one
    for its weight version; the ranks can address each engine)."""
    return f"{pool}-engines"


def api_key_secret_name(job: str) -> str:
    """The Secret holding the job's shared API key (created once by the RLJob reconcile)."""
    return f"{job}-api-key"


API_KEY_ITEM = "api-key"
"""The key's item in that Secret."""
POD_IP_ENV = "POD_IP"
"""The pod's IP (downward API): what servers in the pod bind instead of all interfaces."""


def engine_network_policy_name(pool: str) -> str:
    """The NetworkPolicy guarding a pool's engine pods (named like the pool)."""
    return pool


BASELINE_NETWORK_POLICY = "lockstep-job-pods"
"""The namespace's baseline NetworkPolicy (resources.network.baseline_network_policy): one per namespace
with jobs, owned by nothing, so a job's pods are never open before their own policies exist."""


def driver_network_policy_name(job: str) -> str:
    """The NetworkPolicy of the driver pod, where the session server runs (named like the driver)."""
    return driver_name(job)
