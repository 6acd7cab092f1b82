"""kopf registrations only: which events kick which reconciles. No logic lives here.

The operator is level-triggered: every watch event of our four kinds, of the jobs' pods and progress
ConfigMaps, and a periodic timer per RLJob only kick keys of the work queue (workqueue.WorkQueue),
which runs the reconcile of each key (reconcile.run). kopf's bookkeeping stays out of user-facing
status: handlers keep no state and return None; its finalizer and annotations use rl.lockstep.dev.
kopf's watches log in with the operator's own credentials (k8s.client: kubeconfig with exec plugins,
or the in-cluster ServiceAccount). Used by `python -m lockstep_operator` and the e2e tests
(`kopf.testing.KopfRunner(["run", "-m", "lockstep_operator.handlers", ...])`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import kopf

from lockstep_operator.k8s.client import KubeClient, load_credentials
from lockstep_operator.reconcile import Key, dispatch
from lockstep_operator.resources.common import (
    GROUP,
    LABEL_JOB,
    LABEL_POOL,
    LABEL_ROLE,
    LABEL_TRAINER,
    channel_name,
    pool_name,
    trainer_name,
)
from lockstep_operator.settings import load_settings
from lockstep_operator.workqueue import WorkQueue

VERSION = "v1alpha1"
SETTINGS = load_settings()


def _family(job: str, namespace: str) -> list[Key]:
    return [
        ("RLJob", namespace, job),
        ("RolloutPool", namespace, pool_name(job)),
        ("TrainerGroup", namespace, trainer_name(job)),
        ("WeightChannel", namespace, channel_name(job)),
    ]


async def _client(memo: Any) -> KubeClient:
    """The operator's API client, created once (startup or the first login, whichever runs first)."""
    if "kube" not in memo:
        kube = KubeClient(await load_credentials())
        memo["kube"] = await kube.__aenter__()
    return memo["kube"]  # type: ignore[no-any-return]


@kopf.on.login()
async def login(memo: Any, **_: Any) -> kopf.ConnectionInfo:
    """kopf's watches use the reconciles' credentials: one loader for kubeconfig (exec plugins, tokens,
    client certificates) and in-cluster (the token read again at each login: kopf logs in again when
    the API server rejects the old one)."""
    kube = await _client(memo)
    conf = kube.credentials.configuration
    return kopf.ConnectionInfo(
        server=conf.host,
        ca_path=conf.ssl_ca_cert,
        insecure=not conf.verify_ssl,
        token=await kube.bearer_token(),
        certificate_path=conf.cert_file,
        private_key_path=conf.key_file,
    )


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    """Keep kopf's bookkeeping under rl.lockstep.dev annotations, set the peering lifetime; open the
    API client and the work queue."""
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING
    settings.peering.lifetime = SETTINGS.peering_lifetime_seconds
    settings.peering.stealth = True  # keep-alives are not logged (pauses and resumes still are)
    settings.watching.server_timeout = 120
    settings.watching.connect_timeout = 10
    kube = await _client(memo)
    memo["queue"] = WorkQueue(dispatch(kube, SETTINGS))


@kopf.on.cleanup()
async def cleanup(memo: Any, **_: Any) -> None:
    """Stop pending passes and close the client."""
    if "queue" in memo:
        await memo["queue"].close()
    if "kube" in memo:
        await memo["kube"].close()
        memo["kube"].credentials.close()


@kopf.on.probe(id="reconciles")
async def probe_reconciles(memo: Any, **_: Any) -> int:
    """Liveness detail: objects with a reconcile in flight."""
    return memo["queue"].in_flight if "queue" in memo else 0


def _echo(memo: Any, kind: str, body: kopf.Body) -> bool:
    """Whether this event only shows our own last write of the object (nothing new to reconcile)."""
    meta = body.get("metadata") or {}
    key = (kind, str(meta.get("namespace", "")), str(meta.get("name", "")))
    return bool(meta.get("resourceVersion")) and memo["kube"].written.get(key) == meta.get("resourceVersion")


def _kick(memo: kopf.Memo, keys: list[Key]) -> None:
    queue: WorkQueue = memo["queue"]
    for key in keys:
        queue.kick(key)


@kopf.on.event(GROUP, VERSION, "rljobs")
async def rljob_event(
    type: str, name: str, namespace: str | None, body: kopf.Body, memo: Any, **_: Any
) -> None:
    """An RLJob appeared or its spec changed: reconcile it.

    A MODIFIED event whose generation the status already observed is the echo of our own status
    write (or kopf's finalizer): skipped. Children's events and the periodic re-check cover the rest.
    """
    if type == "DELETED":
        return
    observed = (body.get("status") or {}).get("observedGeneration")
    if type == "MODIFIED" and observed is not None and observed == body["metadata"].get("generation"):
        return
    if type == "MODIFIED" and _echo(memo, "RLJob", body):
        return
    _kick(memo, [("RLJob", namespace or "", name)])


@kopf.timer(GROUP, VERSION, "rljobs", interval=SETTINGS.resync_seconds, initial_delay=SETTINGS.resync_seconds)
async def rljob_resync(name: str, namespace: str | None, memo: Any, **_: Any) -> None:
    """Periodic level-triggered re-check of a job and its children."""
    _kick(memo, _family(name, namespace or ""))


def _child_event(kind: str) -> Callable[..., Awaitable[None]]:
    async def handler(
        type: str, name: str, namespace: str | None, body: kopf.Body, memo: Any, **_: Any
    ) -> None:
        if type == "DELETED":
            return
        # The echo of our own status write needs no pass of the child itself; the job still folds it.
        keys: list[Key] = (
            [] if type == "MODIFIED" and _echo(memo, kind, body) else [(kind, namespace or "", name)]
        )
        job = (body.get("spec") or {}).get("job")
        if job:
            keys.append(("RLJob", namespace or "", str(job)))  # the job folds its children's status
        _kick(memo, keys)

    return handler


for _plural, _kind in (
    ("rolloutpools", "RolloutPool"),
    ("trainergroups", "TrainerGroup"),
    ("weightchannels", "WeightChannel"),
):
    kopf.on.event(GROUP, VERSION, _plural, id=f"{_plural}_event")(_child_event(_kind))


@kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
async def pod_event(
    type: str, namespace: str | None, labels: Mapping[str, str], body: kopf.Body, memo: Any, **_: Any
) -> None:
    """A pod of a job changed: reconcile its owner, and the weight channel once placement is known."""
    job, role, namespace = labels[LABEL_JOB], labels.get(LABEL_ROLE), namespace or ""
    placed = bool((body.get("spec") or {}).get("nodeName")) or type == "DELETED"
    keys: list[Key] = [("WeightChannel", namespace, channel_name(job))] if placed and role != "driver" else []
    if role == "engine" and LABEL_POOL in labels:
        keys.append(("RolloutPool", namespace, labels[LABEL_POOL]))
    elif role == "trainer" and LABEL_TRAINER in labels:
        keys.append(("TrainerGroup", namespace, labels[LABEL_TRAINER]))
    else:
        keys.append(("RLJob", namespace, job))
    _kick(memo, keys)


@kopf.on.event("", "v1", "configmaps", labels={LABEL_JOB: kopf.PRESENT, LABEL_ROLE: "driver"})
async def progress_event(namespace: str | None, labels: Mapping[str, str], memo: Any, **_: Any) -> None:
    """The driver reported progress: every object of the job folds it in."""
    _kick(memo, _family(labels[LABEL_JOB], namespace or ""))
