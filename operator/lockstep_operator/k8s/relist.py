"""The read cache's re-list: each watched kind listed from the API now and then, and after a re-list of
kopf's, so an object deleted while a watch was broken leaves the cache (docs/operator.md, "The read
cache").

Why it exists: the store (k8s/store.py) loses an object only on its DELETED event. When a watch breaks
and resumes with a fresh listing (410 Gone after an API server restart or a long disconnect, or a
peering pause), kopf replays the listed objects but sends nothing for those deleted in the gap: the
store kept them for ever (a rank pod deleted in the gap stayed "running", its gang never restarted). An
informer replaces the kind's contents with its re-list; kopf tells its handlers neither where a
re-list starts nor where it ends (a re-list of nothing sends nothing at all), so the operator lists
each kind itself: one LIST per watched kind (per watched namespace), label-filtered like its watch,
every `cache_relist_seconds`, and about a second after any listed object reaches a handler (the
watches' listings: at start, and after every gap that left something to list). Store.relisted folds
each list in at its resourceVersion; what it drops is handed to `dropped`, which kicks the reconciles
a DELETED event would have.

Who calls it: lockstep_operator.handlers (started with the operator, stopped at its cleanup).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiohttp

from lockstep_operator.k8s.client import ApiError, KubeClient, Manifest, resource_path
from lockstep_operator.k8s.store import Store
from lockstep_operator.resources.common import API_VERSION, LABEL_JOB, LABEL_ROLE

log = logging.getLogger("lockstep_operator.relist")

POD_SELECTOR = LABEL_JOB
"""The pod watch's server-side selector: the jobs' own pods."""
PROGRESS_SELECTOR = f"{LABEL_JOB},{LABEL_ROLE}=driver"
"""The ConfigMap watch's server-side selector: the drivers' progress ConfigMaps."""


@dataclass(frozen=True, slots=True)
class Watched:
    api_version: str
    kind: str
    selector: str | None


WATCHED: tuple[Watched, ...] = (
    Watched(API_VERSION, "RLJob", None),
    Watched(API_VERSION, "RolloutPool", None),
    Watched(API_VERSION, "TrainerGroup", None),
    Watched(API_VERSION, "WeightChannel", None),
    Watched("v1", "Pod", POD_SELECTOR),
    Watched("v1", "ConfigMap", PROGRESS_SELECTOR),
)
"""Every kind the store holds, with its watch's label selector (handlers.py sets the same on kopf)."""

SETTLE_S = 1.0
"""How long after a listed object reached a handler the re-list starts: the rest of that listing's
objects come meanwhile, and one re-list answers them all."""


async def relist(kube: KubeClient, store: Store, namespaces: Sequence[str]) -> list[Manifest]:
    """One re-list of every watched kind into `store` (of `namespaces`, empty: cluster-wide); the
    objects it dropped. A kind whose LIST fails is skipped (logged): the next round lists it again."""
    dropped: list[Manifest] = []
    for watched in WATCHED:
        for namespace in namespaces or (None,):
            try:
                items, version = await _list(kube, watched, namespace)
            except (ApiError, aiohttp.ClientError, OSError, TimeoutError) as err:
                log.warning("re-list of %s failed (%s): the next round lists it again", watched.kind, err)
                continue
            dropped += store.relisted(watched.kind, namespace, items, version)
    return dropped


async def _list(kube: KubeClient, watched: Watched, namespace: str | None) -> tuple[list[Manifest], str]:
    """One LIST of a watched kind, label-filtered like its watch: its objects (kind and apiVersion set,
    which a list's items lack) and the list's resourceVersion."""
    params = {"labelSelector": watched.selector} if watched.selector else None
    answer = await kube.request(
        "GET", resource_path(watched.api_version, watched.kind, namespace), params=params
    )
    items = [
        {"apiVersion": watched.api_version, "kind": watched.kind, **item}
        for item in answer.get("items") or []
    ]
    return items, str((answer.get("metadata") or {}).get("resourceVersion") or "")


async def initial_list(kube: KubeClient, store: Store, namespaces: Sequence[str]) -> None:
    """Every watched kind listed into `store` before any handler runs (the operator's start-up): from the
    first event on, what it lacks does not exist (or its event is on the way), as with an informer's
    first list. The caller marks it synced when its watches deliver (a standby replica of a peering
    pair holds it unsynced, its re-lists off, until it is active). A LIST that fails raises (after the
    client's retries): a store missing a kind would make passes create what exists, so the operator
    does not start on one."""
    for watched in WATCHED:
        for namespace in namespaces or (None,):
            store.relisted(watched.kind, namespace, *await _list(kube, watched, namespace))


class Relister:
    """The loop: a re-list every `period_s`, and SETTLE_S after `soon()` (a listed object was seen)."""

    def __init__(
        self,
        kube: KubeClient,
        store: Store,
        namespaces: Sequence[str],
        *,
        period_s: float,
        dropped: Callable[[Manifest], Awaitable[None]],
    ) -> None:
        self.kube, self.store, self.namespaces = kube, store, tuple(namespaces)
        self.period_s, self.dropped = period_s, dropped
        self.rounds = 0
        """Re-lists done (the tests wait on it)."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cache re-list")

    def soon(self) -> None:
        """A watch delivered a listed object (its listing at start, or a re-list after a gap)."""
        self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def round(self) -> None:
        """One re-list now, when the store is synced (before, no watch has delivered: at start, or on a
        standby replica, whose passes must not run)."""
        if not self.store.synced:
            return
        for body in await relist(self.kube, self.store, self.namespaces):
            await self.dropped(body)
        self.rounds += 1

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.period_s)
                await asyncio.sleep(SETTLE_S)
            self._wake.clear()
            try:
                await self.round()
            except Exception:  # never let the loop die: the next round tries again
                log.exception("re-list of the read cache failed")
