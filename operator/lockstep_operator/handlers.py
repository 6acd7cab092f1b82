"""kopf registrations only: which events trigger which reconcile. No logic lives here.

Why it exists: the operator is level-triggered. Every watch event of our four kinds, of the pods and
of the progress ConfigMaps they own, and a periodic timer on each RLJob, only *kick* a reconcile of
the affected objects; the `Coalescer` runs at most one reconcile per object at a time and folds the
kicks that arrive meanwhile into one more pass, so a burst of pod events costs one or two passes and
two passes of one object never race. A pass that raises is retried with backoff.

kopf's own bookkeeping stays out of user-facing status: event handlers keep no state, the timer
keeps none either, and the finalizer and annotations kopf may write use the rl.lockstep.dev prefix
(configured at startup). Handler return values are None (kopf would store them in status).

Who uses it: `python -m lockstep_operator` (via kopf.run) and the e2e tests
(`kopf.testing.KopfRunner(["run", "-m", "lockstep_operator.handlers", ...])`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import kopf

from lockstep_operator import metrics
from lockstep_operator.k8s.client import ApiError, KubeClient, load_credentials
from lockstep_operator.reconcile.rljob import reconcile_job
from lockstep_operator.reconcile.rolloutpool import reconcile_pool
from lockstep_operator.reconcile.trainergroup import reconcile_trainer
from lockstep_operator.reconcile.weightchannel import reconcile_channel
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
from lockstep_operator.settings import OperatorSettings, load_settings

VERSION = "v1alpha1"
SETTINGS = load_settings()
Key = tuple[str, str, str]
"""(kind, namespace, name) of an object to reconcile."""
log = logging.getLogger("lockstep_operator")


class Coalescer:
    """At most one reconcile per object at a time; kicks during a pass cause exactly one more pass."""

    def __init__(
        self, run: Callable[[Key], Awaitable[None]], *, max_backoff_s: float = 30.0, settle_s: float = 0.25
    ) -> None:
        self._run = run
        self._settle = settle_s
        self._tasks: dict[Key, asyncio.Task[None]] = {}
        self._dirty: set[Key] = set()
        self._max_backoff = max_backoff_s

    def kick(self, key: Key) -> None:
        """Schedule a reconcile of `key` (now, or right after the running pass)."""
        if key in self._tasks:
            self._dirty.add(key)
            return
        self._tasks[key] = asyncio.get_running_loop().create_task(self._loop(key))
        metrics.QUEUED.set(len(self._tasks))

    async def _loop(self, key: Key) -> None:
        backoff = 0.5
        try:
            while True:
                self._dirty.discard(key)
                started = time.perf_counter()
                try:
                    await self._run(key)
                    metrics.RECONCILES.labels(key[0], "ok").inc()
                    backoff = 0.5
                except Exception as err:
                    if isinstance(err, ApiError) and err.status == 404:
                        # The object (or its owner) was deleted during the pass: nothing left to do;
                        # a re-created object brings its own event.
                        metrics.RECONCILES.labels(key[0], "gone").inc()
                    else:  # a failed pass is retried, never lost
                        metrics.RECONCILES.labels(key[0], "error").inc()
                        metrics.ERRORS.labels(key[0], type(err).__name__).inc()
                        log.warning("reconcile of %s %s/%s failed (retry in %.1fs): %s", *key, backoff, err)
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, self._max_backoff)
                        self._dirty.add(key)
                finally:
                    metrics.RECONCILE_SECONDS.labels(key[0]).observe(time.perf_counter() - started)
                if key not in self._dirty:
                    return
                # Kicked during the pass: let the burst of events (pods starting, our own status
                # writes echoing back) settle, then one pass covers all of them.
                await asyncio.sleep(self._settle)
        finally:
            self._tasks.pop(key, None)
            metrics.QUEUED.set(len(self._tasks))

    async def close(self) -> None:
        """Cancel every pending pass (operator shutdown)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def make_runner(kube: KubeClient, settings: OperatorSettings) -> Callable[[Key], Awaitable[None]]:
    """The function the Coalescer runs: dispatch a key to its kind's reconcile."""

    async def run(key: Key) -> None:
        kind, namespace, name = key
        if kind == "RLJob":
            await reconcile_job(kube, namespace, name, settings=settings, now=_now())
        elif kind == "RolloutPool":
            await reconcile_pool(kube, namespace, name, settings=settings, now=_now())
        elif kind == "TrainerGroup":
            await reconcile_trainer(kube, namespace, name, settings=settings, now=_now())
        elif kind == "WeightChannel":
            await reconcile_channel(kube, namespace, name, now=_now())

    return run


def _family(job: str, namespace: str) -> list[Key]:
    return [
        ("RLJob", namespace, job),
        ("RolloutPool", namespace, pool_name(job)),
        ("TrainerGroup", namespace, trainer_name(job)),
        ("WeightChannel", namespace, channel_name(job)),
    ]


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Credentials from $KUBECONFIG (or ~/.kube/config), else the in-cluster service account.

    Decided at login time: kopf's own fallbacks are chosen when its registry is created (at the first
    import of this module), which may be before KUBECONFIG is set (tests, embedding).
    """
    if os.environ.get("KUBECONFIG") or os.path.exists(os.path.expanduser("~/.kube/config")):
        return kopf.login_with_kubeconfig(**kwargs)
    return kopf.login_with_service_account(**kwargs)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    """Keep kopf's bookkeeping under rl.lockstep.dev annotations, set the peering lifetime; open the API client."""
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING
    settings.peering.lifetime = SETTINGS.peering_lifetime_seconds
    settings.peering.stealth = True  # keep-alives are not logged (pauses and resumes still are)
    settings.watching.server_timeout = 120
    settings.watching.connect_timeout = 10
    kube = KubeClient(load_credentials())
    await kube.__aenter__()
    memo["kube"] = kube
    memo["coalescer"] = Coalescer(make_runner(kube, SETTINGS))


@kopf.on.cleanup()
async def cleanup(memo: Any, **_: Any) -> None:
    """Stop pending passes and close the client."""
    await memo["coalescer"].close()
    await memo["kube"].close()


@kopf.on.probe(id="reconciles")
async def probe_reconciles(memo: Any, **_: Any) -> int:
    """Liveness detail: objects with a reconcile in flight."""
    return len(memo["coalescer"]._tasks) if "coalescer" in memo else 0


def _echo(memo: Any, kind: str, body: kopf.Body) -> bool:
    """Whether this event only shows our own last write of the object (nothing new to reconcile)."""
    meta = body.get("metadata") or {}
    key = (kind, str(meta.get("namespace", "")), str(meta.get("name", "")))
    return bool(meta.get("resourceVersion")) and memo["kube"].written.get(key) == meta.get("resourceVersion")


def _kick(memo: kopf.Memo, keys: list[Key]) -> None:
    coalescer: Coalescer = memo["coalescer"]
    for key in keys:
        coalescer.kick(key)


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
