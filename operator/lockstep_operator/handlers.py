"""kopf registrations only: which events kick which reconciles. No logic lives here.

The operator is level-triggered: every watch event of our four kinds, of the jobs' pods and progress
ConfigMaps, a periodic timer per RLJob, and the operator's own writes that changed one of the four
kinds (KubeClient.on_write) only kick keys of the work queue (workqueue.WorkQueue), which runs the
reconcile of each key (reconcile.run). kopf's bookkeeping stays out of user-facing
status: handlers keep no state and return None; its finalizer and annotations use rl.lockstep.dev.
kopf's watches log in with the operator's own credentials (k8s.client: kubeconfig with exec plugins,
or the in-cluster ServiceAccount). Used by `python -m lockstep_operator` and the e2e tests
(`kopf.testing.KopfRunner(["run", "-m", "lockstep_operator.handlers", ...])`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

import kopf

from lockstep_operator.k8s.client import ApiError, KubeClient, load_credentials
from lockstep_operator.k8s.events import EventSink
from lockstep_operator.k8s.gate import RequestGate
from lockstep_operator.k8s.relist import POD_SELECTOR, PROGRESS_SELECTOR, Relister, initial_list
from lockstep_operator.k8s.store import Store
from lockstep_operator.policy.adapter_gc import adapter_of
from lockstep_operator.reconcile import Key, dispatch
from lockstep_operator.resources.adapter_gc import ROLE as UNLOAD_ROLE
from lockstep_operator.resources.annotations import Annotation
from lockstep_operator.resources.common import (
    API_VERSION,
    GROUP,
    LABEL_JOB,
    LABEL_POOL,
    LABEL_POOL_CLIENT,
    LABEL_ROLE,
    LABEL_TRAINER,
    channel_name,
    pool_name,
    trainer_name,
)
from lockstep_operator.settings import load_settings
from lockstep_operator.workqueue import Backoff, RateLimit, WorkQueue

VERSION = "v1alpha1"
SETTINGS = load_settings()


_FAMILY_KINDS = frozenset({"RLJob", "RolloutPool", "TrainerGroup", "WeightChannel"})
"""The kinds of the work queue's keys."""


def _family(job: str, namespace: str) -> list[Key]:
    return [
        ("RLJob", namespace, job),
        ("RolloutPool", namespace, pool_name(job)),
        ("TrainerGroup", namespace, trainer_name(job)),
        ("WeightChannel", namespace, channel_name(job)),
    ]


def _recheck(memo: Any, key: Key) -> list[Key]:
    """What a pass of `key` re-checks resync_seconds later: a job's family, while the cache holds the
    job. A deleted job re-checks nothing: a pass that found it gone (a late child or pod event kicks it)
    would otherwise arm its timer again, and every deleted job's family passed each period for as long
    as the operator ran (passes and timers grew with every job ever deleted)."""
    if key[0] != "RLJob" or not memo["store"].has(*key):
        return []
    return _family(key[2], key[1])


async def _client(memo: Any) -> KubeClient:
    """The operator's API client, created once (startup or the first login, whichever runs first)."""
    if "kube" not in memo:
        kube = KubeClient(
            await load_credentials(),
            gate=RequestGate(SETTINGS.max_in_flight_requests),
            apply_cache_ttl_s=SETTINGS.apply_refresh_seconds,
        )
        memo["kube"] = await kube.__aenter__()
    return memo["kube"]  # type: ignore[no-any-return]


class EventOnlyDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff base for an operator with event handlers only: no essence.

    For every watch event kopf builds the object's "essence" (two deep copies of the body) to diff it
    for change handlers (on.create/update/...). This operator registers none (test_handlers checks),
    so the essence is never used; building it was the largest share of the operator's CPU under a
    burst of pod events. Nothing is stored either (kopf stores a diff base only for change handlers).
    """

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()


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
    settings.persistence.diffbase_storage = EventOnlyDiffBase(prefix=GROUP)
    settings.posting.level = logging.WARNING
    settings.peering.lifetime = SETTINGS.peering_lifetime_seconds
    settings.peering.stealth = True  # keep-alives are not logged (pauses and resumes still are)
    settings.watching.server_timeout = 120
    settings.watching.connect_timeout = 10
    # The CRDs are installed before the operator (Helm's crds/, kustomize's first documents): no
    # watch of CRDs or namespaces, so the operator needs no right to read either.
    settings.scanning.disabled = True
    # The API server filters pods and config maps: only the jobs' own objects reach the operator.
    settings.watching.label_selectors["", "v1", "pods"] = POD_SELECTOR
    settings.watching.label_selectors["", "v1", "configmaps"] = PROGRESS_SELECTOR
    kube = await _client(memo)
    if SETTINGS.ha_mode == "peering" and not settings.peering.standalone:  # `kopf run --standalone`: none
        await ensure_peering(kube, SETTINGS.peering_name, SETTINGS.namespaces)
    # The reconciles read from the watch-fed cache (k8s/store.py): listed here, before kopf starts its
    # watches, then kept by the event handlers below (one handler per event: kopf's index handlers,
    # which used to fill it, cost a second handler call per event, a tenth of the operator's CPU).
    store = Store({"Pod": {LABEL_JOB: None}, "ConfigMap": {LABEL_JOB: None, LABEL_ROLE: "driver"}})
    await initial_list(kube, store, SETTINGS.namespaces)
    memo["store"] = kube.store = store
    # A child the operator's own pass created or changed passes at once, one watch hop sooner (its
    # event, which may queue behind a burst's others, is then an echo: _child_event skips it).
    kube.on_write = lambda key: _written(memo, key)
    sink = EventSink(kube, instance=os.environ.get("POD_NAME", ""))
    memo["queue"] = WorkQueue(
        dispatch(kube, SETTINGS, sink),
        backoff=Backoff(initial_s=1.0, max_s=SETTINGS.retry_max_seconds),
        limit=RateLimit(
            qps=SETTINGS.reconcile_qps,
            burst=SETTINGS.reconcile_burst,
            max_concurrent=SETTINGS.max_concurrent_reconciles,
        ),
        # The periodic level-triggered re-check: a job and its children every resync_seconds while
        # the job passes, never postponed by its passes (a work-queue timer, not a kopf timer: no
        # finalizer on the RLJob).
        resync=lambda key: _recheck(memo, key),
        resync_s=SETTINGS.resync_seconds,
    )
    # What a broken watch's re-list cannot tell (deletions in the gap) the cache learns by listing
    # each kind itself (k8s/relist.py); what it drops gets the DELETED event's handling.
    memo["relist"] = Relister(
        kube,
        memo["store"],
        SETTINGS.namespaces,
        period_s=SETTINGS.cache_relist_seconds,
        dropped=lambda body: _gone(memo, body),
    )
    memo["relist"].start()


async def ensure_peering(kube: KubeClient, name: str, namespaces: tuple[str, ...]) -> None:
    """Create kopf's peering object(s) if missing: a ClusterKopfPeering for a cluster-wide operator, a
    KopfPeering in each watched namespace for a namespaced one. An install (kustomize, Helm) ships only
    their CRDs: a CRD and an object of it in one `kubectl apply` fails on an empty cluster."""
    objects = (
        [
            {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": name, "namespace": ns}}
            for ns in namespaces
        ]
        if namespaces
        else [{"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}]
    )
    for peering in objects:
        try:
            await kube.create(peering)
        except ApiError as err:
            if err.status != 409:
                raise


@kopf.on.cleanup()
async def cleanup(memo: Any, **_: Any) -> None:
    """Stop the re-list and pending passes, and close the client."""
    if "relist" in memo:
        await memo["relist"].close()
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


def _kick(memo: kopf.Memo, keys: list[Key], *, urgent: bool = False) -> None:
    # The store was listed at start-up, before kopf's watches; an event reaching a handler means this
    # replica is active (kopf runs no handler on a paused peer), so its reads and re-lists go on.
    memo["store"].synced = True
    queue: WorkQueue = memo["queue"]
    for key in keys:
        queue.kick(key, urgent=urgent)


def _written(memo: Any, key: Key) -> None:
    """The operator's own write changed an object (KubeClient.on_write): pass it if it is a key."""
    if key[0] in _FAMILY_KINDS:
        memo["queue"].kick(key)


def _listed(memo: Any, type: str | None, body: kopf.Body) -> None:
    """Every event's object into the store first (the DELETED ones leave it through _forget). An
    object of a watch's listing (event type None: at start, or after a gap, when kopf lists the kind
    again): the cache re-lists soon, dropping what was deleted in the gap (k8s/relist.py)."""
    if type != "DELETED":
        memo["store"].observe(dict(body))
    if type is None and "relist" in memo:
        memo["relist"].soon()


async def _gone(memo: Any, body: dict[str, Any]) -> None:
    """An object the cache's re-list found gone: handled as its DELETED event would have been."""
    meta = body["metadata"]
    await _HANDLERS[str(body["kind"])](
        type="DELETED",
        name=meta["name"],
        namespace=meta.get("namespace"),
        labels=meta.get("labels") or {},
        body=kopf.Body(cast(kopf.RawBody, body)),
        memo=memo,
    )


def _forget(memo: Any, body: kopf.Body) -> None:
    meta = body.get("metadata") or {}
    memo["store"].forget(
        str(body.get("kind")),
        str(meta.get("namespace") or ""),
        str(meta.get("name")),
        meta.get("resourceVersion"),
        meta.get("uid"),
    )


@kopf.on.event(GROUP, VERSION, "rljobs")
async def rljob_event(
    type: str, name: str, namespace: str | None, body: kopf.Body, memo: Any, **_: Any
) -> None:
    """An RLJob appeared or its spec changed: reconcile it.

    A MODIFIED event whose generation the status already observed is the echo of our own status
    write (or kopf's finalizer): skipped. Children's events and the periodic re-check cover the rest.
    """
    _listed(memo, type, body)
    ref = ((body.get("spec") or {}).get("rollout") or {}).get("poolRef") or {}
    if type == "DELETED":
        _forget(memo, body)
        memo["queue"].forget(("RLJob", namespace or "", name))
        if ref.get("name"):  # its adapter no longer gates the standalone pool's engines
            _kick(memo, [("RolloutPool", namespace or "", str(ref["name"]))])
        return
    if ref.get("name") and (body.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        _kick(memo, [("RolloutPool", namespace or "", str(ref["name"]))])  # its adapter leaves the pool
    observed = (body.get("status") or {}).get("observedGeneration")
    if type == "MODIFIED" and observed is not None and observed == body["metadata"].get("generation"):
        return
    if type == "MODIFIED" and _echo(memo, "RLJob", body):
        return
    # A spec the status has not seen yet is the user's change: retry at once even after failures.
    _kick(memo, [("RLJob", namespace or "", name)], urgent=observed is not None)


def _child_event(kind: str) -> Callable[..., Awaitable[None]]:
    async def handler(
        type: str, name: str, namespace: str | None, body: kopf.Body, memo: Any, **_: Any
    ) -> None:
        _listed(memo, type, body)
        job = (body.get("spec") or {}).get("job")
        if type == "DELETED":
            _forget(memo, body)
            # Deleted by hand (or by its job's deletion): its job's next pass applies it again at once,
            # not only once the apply cache's entry expires (settings.apply_refresh_seconds).
            memo["kube"].forget_applied(API_VERSION, kind, namespace, name)
            if job:
                _kick(memo, [("RLJob", namespace or "", str(job))])
            return
        # The echo of our own write needs no pass of the child itself (a status write needs none, any
        # other write kicked it already: KubeClient.on_write); the job still folds it.
        echo = type in ("ADDED", "MODIFIED") and _echo(memo, kind, body)
        keys: list[Key] = [] if echo else [(kind, namespace or "", name)]
        if job:
            keys.append(("RLJob", namespace or "", str(job)))  # the job folds its children's status
        _kick(memo, keys)

    return handler


_CHILDREN = {
    _kind: kopf.on.event(GROUP, VERSION, _plural, id=f"{_plural}_event")(_child_event(_kind))
    for _plural, _kind in (
        ("rolloutpools", "RolloutPool"),
        ("trainergroups", "TrainerGroup"),
        ("weightchannels", "WeightChannel"),
    )
}


@kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
async def pod_event(
    type: str, namespace: str | None, labels: Mapping[str, str], body: kopf.Body, memo: Any, **_: Any
) -> None:
    """A pod of a job changed: reconcile its owner, and the weight channel once placement is known."""
    _listed(memo, type, body)
    if type == "DELETED":
        _forget(memo, body)
    job, role, namespace = labels[LABEL_JOB], labels.get(LABEL_ROLE), namespace or ""
    placed = bool((body.get("spec") or {}).get("nodeName")) or type == "DELETED"
    channel = placed and role not in ("driver", UNLOAD_ROLE)
    keys: list[Key] = [("WeightChannel", namespace, channel_name(job))] if channel else []
    if role == UNLOAD_ROLE and LABEL_POOL_CLIENT in labels:  # a pool's adapter unload (reconcile.adapter_gc)
        pool = labels[LABEL_POOL_CLIENT]
        keys.append(("RolloutPool", namespace, pool))
        if type == "DELETED":  # a job created again under the adapter's name waited for it (policy.pool_ref)
            adapter = (body.get("metadata", {}).get("annotations") or {}).get(Annotation.ADAPTER.value)
            jobs = memo["store"].list("RLJob", namespace, None)
            keys += [
                ("RLJob", namespace, j["metadata"]["name"]) for j in jobs if adapter_of(j, pool) == adapter
            ]
    elif role == "engine" and LABEL_POOL in labels:
        keys.append(("RolloutPool", namespace, labels[LABEL_POOL]))
    elif role == "trainer" and LABEL_TRAINER in labels:
        keys.append(("TrainerGroup", namespace, labels[LABEL_TRAINER]))
    else:
        keys.append(("RLJob", namespace, job))
    _kick(memo, keys)


@kopf.on.event("", "v1", "configmaps", labels={LABEL_JOB: kopf.PRESENT, LABEL_ROLE: "driver"})
async def progress_event(
    type: str, namespace: str | None, labels: Mapping[str, str], body: kopf.Body, memo: Any, **_: Any
) -> None:
    """The driver reported progress: every object of the job folds it in, and the standalone pool it
    samples on (its engines' readiness follows the job's adapter version)."""
    _listed(memo, type, body)
    if type == "DELETED":
        _forget(memo, body)
    shared = (
        [("RolloutPool", namespace or "", labels[LABEL_POOL_CLIENT])] if LABEL_POOL_CLIENT in labels else []
    )
    _kick(memo, [*_family(labels[LABEL_JOB], namespace or ""), *shared])


_HANDLERS: dict[str, Callable[..., Any]] = {
    "RLJob": rljob_event,
    **_CHILDREN,
    "Pod": pod_event,
    "ConfigMap": progress_event,
}
"""Each cached kind's event handler (a re-list's dropped objects go through its DELETED branch)."""
