"""Posting Kubernetes Events: collected during a pass, posted after its status write, deduplicated and
rate-limited per object.

Why it exists: events are how `kubectl describe` tells a run's story, but an operator that posts one
per pass floods etcd (events are objects) and buries the one that matters. So, like client-go's event
correlator:
- an event identical to one posted less than `dedup_window_s` ago (same object, type, reason and
  message) is not created again: the existing Event's `count` and `lastTimestamp` are patched;
- more than `similar_limit` distinct messages of one object, type and reason in that window are
  combined into one Event whose message says so (a flapping condition stays one line);
- each object has a token bucket (`burst` events, one more every `refill_s`): beyond it, events are
  dropped and counted (`lockstep_operator_events_dropped_total`);
- posting never fails a reconcile: an API error is logged and counted.

Events go to the core v1 API (what `kubectl describe` and `kubectl get events` read). A child's event
(an engine replaced, a gang restart) is also posted on its RLJob, so describing the job shows the whole
story. Who calls it: the reconciles through a per-pass `Recorder` (reconcile/__init__.dispatch flushes
it after the pass), the error path (reconcile/errors.py).
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lockstep_operator import metrics
from lockstep_operator.k8s.client import ApiError, KubeClient
from lockstep_operator.policy.events import Event

log = logging.getLogger("lockstep_operator.events")

COMPONENT = "lockstep-operator"
"""source.component / reportingComponent of every event (kubectl describe's "From" column)."""
MAX_MESSAGE = 1024
"""Event messages are cut to this many characters (the API allows more; describe shows one line)."""


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """The object an event is about (its involvedObject)."""

    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> ObjectRef:
        """The reference of an object as read from the API."""
        meta = body["metadata"]
        return cls(
            body["apiVersion"], body["kind"], meta.get("namespace") or "", meta["name"], meta.get("uid", "")
        )

    @classmethod
    def owner_of(cls, body: Mapping[str, Any]) -> ObjectRef | None:
        """The controller owner of `body` (a child's RLJob), if it has one."""
        meta = body["metadata"]
        for ref in meta.get("ownerReferences") or []:
            if ref.get("controller"):
                return cls(
                    ref["apiVersion"], ref["kind"], meta.get("namespace") or "", ref["name"], ref["uid"]
                )
        return None


def _rfc3339(now: dt.datetime) -> str:
    return now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(slots=True)
class _Posted:
    name: str
    count: int
    at: float


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


@dataclass
class EventSink:
    """Posts events with deduplication, aggregation and a per-object token bucket (see the module)."""

    kube: KubeClient
    """The operator's client (events: create, patch)."""
    instance: str = ""
    """reportingInstance: the operator pod's name."""
    burst: int = 25
    """Events one object may get at once."""
    refill_s: float = 300.0
    """One more event allowed per this many seconds, per object (client-go's spam filter: 1 per 5 min)."""
    dedup_window_s: float = 600.0
    """Identical events within this window only raise the count of the first."""
    similar_limit: int = 10
    """Distinct messages of one object, type and reason in the window before they are combined."""
    clock: Callable[[], float] = time.monotonic
    """Monotonic seconds (tests inject a fake)."""
    wall: Callable[[], dt.datetime] = field(default=lambda: dt.datetime.now(dt.UTC))
    """Wall-clock time for the timestamps."""
    _posted: OrderedDict[tuple[str, ...], _Posted] = field(default_factory=OrderedDict, init=False)
    _similar: dict[tuple[str, ...], list[float]] = field(default_factory=dict, init=False)
    _buckets: OrderedDict[str, _Bucket] = field(default_factory=OrderedDict, init=False)

    MAX_KEYS = 4096

    async def post(self, ref: ObjectRef, event: Event) -> bool:
        """Post `event` about `ref`; False when it was dropped (rate limit) or the API refused it."""
        now = self.clock()
        message = event.message[:MAX_MESSAGE]
        key = (ref.uid or ref.name, event.type, event.reason.value, message)
        seen = self._posted.get(key)
        if seen is None or now - seen.at > self.dedup_window_s:
            message = self._combine(ref, event, message, now)
            key = (ref.uid or ref.name, event.type, event.reason.value, message)
            seen = self._posted.get(key)
            if seen is not None and now - seen.at > self.dedup_window_s:
                seen = None
        if not self._take(ref.uid or ref.name, now):
            metrics.EVENTS_DROPPED.labels(event.reason.value).inc()
            log.debug(
                "event %s on %s %s/%s dropped by the rate limit",
                event.reason,
                ref.kind,
                ref.namespace,
                ref.name,
            )
            return False
        try:
            if seen is not None and await self._bump(ref, seen):
                seen.at = now
                self._posted.move_to_end(key)
                return True
            name = await self._create(ref, event, message)
        except (ApiError, OSError, TimeoutError) as err:
            metrics.EVENTS_FAILED.inc()
            log.warning(
                "could not post event %s on %s %s/%s: %s",
                event.reason,
                ref.kind,
                ref.namespace,
                ref.name,
                err,
            )
            return False
        self._posted[key] = _Posted(name, 1, now)
        while len(self._posted) > self.MAX_KEYS:
            self._posted.popitem(last=False)
        metrics.EVENTS.labels(event.type, event.reason.value).inc()
        return True

    def _combine(self, ref: ObjectRef, event: Event, message: str, now: float) -> str:
        """The message to post: itself, or marked combined once too many similar ones were posted."""
        similar = (ref.uid or ref.name, event.type, event.reason.value)
        recent = [t for t in self._similar.get(similar, []) if now - t <= self.dedup_window_s]
        recent.append(now)
        self._similar[similar] = recent[-(self.similar_limit + 1) :]
        if len(self._similar) > self.MAX_KEYS:
            self._similar.pop(next(iter(self._similar)))
        if len(recent) > self.similar_limit:
            return "(combined from similar events): " + message
        return message

    def _take(self, who: str, now: float) -> bool:
        bucket = self._buckets.get(who)
        if bucket is None:
            bucket = self._buckets[who] = _Bucket(float(self.burst), now)
            while len(self._buckets) > self.MAX_KEYS:
                self._buckets.popitem(last=False)
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) / self.refill_s)
        bucket.at = now
        self._buckets.move_to_end(who)
        if bucket.tokens < 1.0:
            return False
        bucket.tokens -= 1.0
        return True

    async def _bump(self, ref: ObjectRef, seen: _Posted) -> bool:
        """Raise the count of an Event already posted; False when it is gone (expired: post anew)."""
        patch = {"count": seen.count + 1, "lastTimestamp": _rfc3339(self.wall())}
        try:
            await self.kube.merge_patch("v1", "Event", ref.namespace, seen.name, patch)
        except ApiError as err:
            if err.status == 404:
                return False
            raise
        seen.count += 1
        metrics.EVENTS.labels("Repeat", "count").inc()
        return True

    async def _create(self, ref: ObjectRef, event: Event, message: str) -> str:
        stamp = _rfc3339(self.wall())
        name = f"{ref.name}.{time.time_ns():x}"[:253]
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": ref.namespace},
            "involvedObject": {
                "apiVersion": ref.api_version,
                "kind": ref.kind,
                "namespace": ref.namespace,
                "name": ref.name,
                "uid": ref.uid,
            },
            "type": event.type,
            "reason": event.reason.value,
            "message": message,
            "count": 1,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.instance,
        }
        await self.kube.create(body)
        return name


@dataclass
class Recorder:
    """The events of one reconcile pass, posted by `flush()` after the pass wrote its status."""

    sink: EventSink | None
    """Where they go (None: nowhere; unit tests read `pending`)."""
    pending: list[tuple[ObjectRef, Event]] = field(default_factory=list)
    """What the pass recorded, in order."""

    def record(self, body: Mapping[str, Any], *events: Event, job_too: bool = False) -> None:
        """Record `events` about `body`; with job_too also about its owning RLJob (a child's event)."""
        ref = ObjectRef.of(body)
        owner = ObjectRef.owner_of(body) if job_too else None
        for event in events:
            self.pending.append((ref, event))
            if owner is not None:  # the job's copy names the child it is about
                mirrored = Event(event.type, event.reason, f"{ref.kind} {ref.name}: {event.message}")
                self.pending.append((owner, mirrored))

    async def flush(self) -> None:
        """Post what was recorded (after the status write), then forget it."""
        pending, self.pending = self.pending, []
        if self.sink is None:
            return
        for ref, event in pending:
            await self.sink.post(ref, event)
