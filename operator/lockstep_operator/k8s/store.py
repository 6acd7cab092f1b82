"""The reconciles' read cache: every object the operator watches, as last seen (an informer's store).

Why it exists: a pass used to GET its object, its children, the progress ConfigMap and LIST its pods
on every run: about 120 API requests per job, most of the operator's cost under a burst of jobs.
controller-runtime reads from the watch-fed cache instead; so does this. It is listed at the
operator's start, before kopf starts its watches (k8s/relist.initial_list: complete before the first
pass, like an informer's first list; marked synced by the first event a handler gets), then kopf's
watch streams keep it (each event handler puts its object in first), the DELETED events empty it, and every answer of our own writes (apply, create, patch, a
status write, a delete) goes in too, so a pass never reads older state than its own last write (a
gang restart counted in status is never counted again from a stale copy). An object is replaced
only by a copy with a resourceVersion at least as new. A deleted object's uid is remembered (a
tombstone): a copy of it read after its DELETED event (the answer of the DELETE itself, which for a
Failed or unscheduled pod the API server sends at the same moment as the event, on another
connection) never comes back into the store, where no event would remove it again (a gang restart
waited for such a ghost rank for ever). A watch gap (kopf re-lists after 410 Gone, and deletions in
the gap send no event) is closed by listing each kind now and then (k8s/relist.py, `relisted`): what
the list lacks and is not newer than it is dropped. Reads return copies. Objects are held without
metadata.managedFields (controller-runtime's TransformStripManagedFields: no reconcile reads them,
and they are most of a pod's bytes), and copied by pickle, several times faster than copy.deepcopy
on these plain JSON trees (the copies were a large share of the operator's CPU under a burst).

Which objects: the four kinds, pods labelled with a job, the drivers' progress ConfigMaps (the watches'
server-side label selectors; handlers.py): every object of these kinds the operator reads. Once
synced the store is authoritative for them: an object it does not hold does not exist (or the
watch has not delivered it yet, as with controller-runtime's cache; the next event brings it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from lockstep_operator.resources.common import LABEL_JOB, LABEL_POOL, clone

log = logging.getLogger("lockstep_operator.store")

Manifest = dict[str, Any]

CACHED_KINDS = frozenset({"RLJob", "RolloutPool", "TrainerGroup", "WeightChannel", "Pod", "ConfigMap"})
"""Kinds the store holds (for Pod and ConfigMap: the labelled ones the operator watches)."""
LISTED_KINDS = frozenset({"Pod"})
"""Kinds whose LIST the store answers (the watch holds every pod a job's selector can match)."""
INDEXED_LABELS = (LABEL_JOB, LABEL_POOL)
"""Labels a list looks objects up by (every selector the reconciles use names one of them): a list
reads only that job's or pool's pods, not every pod of the namespace (a burst of 50 jobs made the
scans a twentieth of the operator's CPU, growing with the namespace)."""

TOMBSTONES = 16384
"""Uids of deleted objects remembered (oldest dropped first): far more deletions than can be in flight
while their answers are read."""


def _version(body: Mapping[str, Any]) -> int | None:
    value = str((body.get("metadata") or {}).get("resourceVersion") or "")
    return int(value) if value.isdigit() else None


def _stripped(body: Mapping[str, Any]) -> Manifest:
    """A copy of `body` without metadata.managedFields."""
    meta = {k: v for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
    return clone({**body, "metadata": meta})


def parse_selector(selector: str) -> dict[str, str]:
    """`a=b,c=d` (equality terms only, what resources.common.selector writes) as a dict."""
    out: dict[str, str] = {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, sep, value = term.partition("=")
        if not sep or key.endswith("!"):
            raise ValueError(f"the store answers equality selectors only, not {term!r}")
        out[key] = value
    return out


class Store:
    """Objects by (kind, namespace, name), newest resourceVersion kept."""

    def __init__(self, required_labels: Mapping[str, Mapping[str, str | None]] | None = None) -> None:
        self._objects: dict[tuple[str, str], dict[str, Manifest]] = {}
        self._by_label: dict[tuple[str, str, str, str], set[str]] = {}
        """(kind, namespace, label, value) -> names, for the labels of INDEXED_LABELS."""
        self._deleted: dict[str, None] = {}
        """Tombstones: uids of deleted objects, oldest first (a dict keeps insertion order)."""
        self.required_labels = dict(required_labels or {})
        """kind -> labels an object must carry to be held (value None: any value), i.e. what its watch
        selects: a written object the watch would not report (so never delete) stays out."""
        self.synced = False
        """True once kopf indexed every watched kind's initial listing (handlers.py sets it)."""

    def __len__(self) -> int:
        return sum(len(v) for v in self._objects.values())

    def holds(self, kind: str) -> bool:
        """Whether reads of `kind` may come from here."""
        return self.synced and kind in CACHED_KINDS

    def observe(self, body: Mapping[str, Any]) -> bool:
        """Record `body` (a watch event's object or a write's answer) unless a copy at least as new is
        held (the watch echo of our own write, already held from its answer, is not copied again).
        True when it was recorded: the store had no copy of this version or a newer one."""
        kind, meta = body.get("kind"), body.get("metadata") or {}
        if kind not in CACHED_KINDS or not meta.get("name"):
            return False
        if meta.get("uid") in self._deleted:
            log.info(
                "a copy of deleted %s %s/%s read after its deletion: not held",
                kind,
                meta.get("namespace"),
                meta["name"],
            )
            return False
        labels = meta.get("labels") or {}
        required = self.required_labels.get(str(kind), {})
        if any(k not in labels or (v is not None and labels[k] != v) for k, v in required.items()):
            return False
        bucket = self._objects.setdefault((str(kind), str(meta.get("namespace") or "")), {})
        held = bucket.get(meta["name"])
        new, old = _version(body), _version(held) if held is not None else None
        if held is not None and new is not None and old is not None and new <= old:  # older, or the echo
            return False
        if held is not None:
            self._unindex(str(kind), held)
        bucket[meta["name"]] = stored = _stripped(body)
        self._index(str(kind), stored)
        return True

    def _keys(self, kind: str, body: Manifest) -> list[tuple[str, str, str, str]]:
        meta = body["metadata"]
        labels, namespace = meta.get("labels") or {}, str(meta.get("namespace") or "")
        return [(kind, namespace, label, labels[label]) for label in INDEXED_LABELS if label in labels]

    def _index(self, kind: str, body: Manifest) -> None:
        for key in self._keys(kind, body):
            self._by_label.setdefault(key, set()).add(body["metadata"]["name"])

    def _unindex(self, kind: str, body: Manifest) -> None:
        for key in self._keys(kind, body):
            names = self._by_label.get(key)
            if names is not None:
                names.discard(body["metadata"]["name"])
                if not names:
                    del self._by_label[key]

    def forget(
        self, kind: str, namespace: str, name: str, version: str | None = None, uid: str | None = None
    ) -> None:
        """Drop an object that was deleted (a DELETED event of `uid`, at `version`), unless the store
        holds a re-created one (another uid, or without uids a newer version); remember the uid so no
        late copy of the deleted object is held again."""
        if uid:
            self._bury(uid)
        bucket = self._objects.get((kind, namespace))
        if bucket is None or name not in bucket:
            return
        held_uid = bucket[name]["metadata"].get("uid")
        if uid and held_uid and held_uid != uid:
            return
        held = _version(bucket[name])
        if version is not None and version.isdigit() and held is not None and held > int(version):
            return
        if held_uid:
            self._bury(held_uid)
        self._unindex(kind, bucket.pop(name))

    def relisted(
        self, kind: str, namespace: str | None, items: Iterable[Mapping[str, Any]], version: str | None
    ) -> list[Manifest]:
        """Fold in a LIST of `kind` (of `namespace`, or None: of every namespace) answered at
        resourceVersion `version` and filtered like the kind's watch (items with their kind and
        apiVersion, which a LIST leaves out), as an informer's re-list does
        (docs/operator.md, "The read cache"): every listed object is observed (a held copy at least
        as new, or a tombstone, wins as for any copy), and every held object of that scope the list
        lacks whose resourceVersion is not newer than the list's is dropped and buried: it was deleted
        (or stopped matching the watch's selector) before the list was taken, and its DELETED event
        never came (a watch gap: kopf re-lists after 410 Gone and deletions in the gap send nothing).
        A held object newer than the list was written or created after it and stays. Returns copies
        of the dropped objects (their reconciles need a kick, as a DELETED event would give)."""
        listed: set[tuple[str, str]] = set()
        for item in items:
            meta = item.get("metadata") or {}
            listed.add((str(meta.get("namespace") or ""), str(meta.get("name"))))
            self.observe(item)
        at = int(version) if version and version.isdigit() else None
        if at is None:
            log.warning("a list of %s without a numeric resourceVersion (%r): nothing dropped", kind, version)
            return []
        dropped: list[Manifest] = []
        for (held_kind, held_ns), bucket in list(self._objects.items()):
            if held_kind != kind or (namespace is not None and held_ns != namespace):
                continue
            for name, body in list(bucket.items()):
                held = _version(body)
                if (held_ns, name) in listed or held is None or held > at:
                    continue
                log.info(
                    "%s %s/%s is gone (absent from a list at version %d): dropped", kind, held_ns, name, at
                )
                dropped.append(clone(body))
                self.forget(kind, held_ns, name, uid=body["metadata"].get("uid"))
        return dropped

    def _bury(self, uid: str) -> None:
        """Remember `uid` as deleted (bounded: the oldest tombstone goes first)."""
        self._deleted[uid] = None
        if len(self._deleted) > TOMBSTONES:
            del self._deleted[next(iter(self._deleted))]

    def has(self, kind: str, namespace: str, name: str) -> bool:
        """Whether the store holds the object (no copy made)."""
        return name in self._objects.get((kind, namespace or ""), {})

    def get(self, kind: str, namespace: str, name: str) -> Manifest | None:
        """A copy of the object, or None when the store does not hold it."""
        held = self._objects.get((kind, namespace or ""), {}).get(name)
        return clone(held) if held is not None else None

    def list(self, kind: str, namespace: str, selector: str | None) -> list[Manifest]:
        """Copies of the objects of `kind` in `namespace` whose labels match `selector`."""
        want = parse_selector(selector) if selector else {}
        bucket = self._objects.get((kind, namespace or ""), {})
        by = next((label for label in INDEXED_LABELS if label in want), None)
        if by is None:
            candidates = list(bucket.values())
        else:
            names = self._by_label.get((kind, namespace or "", by, want[by]), set())
            candidates = [bucket[n] for n in sorted(names) if n in bucket]
        out = []
        for body in candidates:
            labels = body["metadata"].get("labels") or {}
            if all(labels.get(k) == v for k, v in want.items()):
                out.append(clone(body))
        return out
