"""The reconciles' read cache: newest resourceVersion wins, a write's answer is never overwritten by an
older watch event, deletions of re-created objects keep the new one, only what the watches select is
held, and pod lists match equality selectors. Pure (no API server)."""

from __future__ import annotations

from typing import Any

import pytest
from lockstep_operator.k8s.store import Store, parse_selector

JOB = "rl.lockstep.dev/job"


def pod(name: str, rv: int, uid: str | None = None, **labels: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": "ns", "resourceVersion": str(rv), "labels": {JOB: "j", **labels}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {**meta, **({"uid": uid} if uid else {})}}


def store() -> Store:
    s = Store({"Pod": {JOB: None}, "ConfigMap": {JOB: None, "rl.lockstep.dev/role": "driver"}})
    s.synced = True
    return s


def test_an_older_watch_event_never_replaces_our_newer_write() -> None:
    s = store()
    s.observe(pod("p", 10, phase="written"))  # the answer of our status write
    s.observe(pod("p", 9, phase="event"))  # the watch event of the state before it, arriving late
    held = s.get("Pod", "ns", "p")
    assert held is not None and held["metadata"]["labels"]["phase"] == "written"
    s.observe(pod("p", 11, phase="later"))
    assert s.get("Pod", "ns", "p")["metadata"]["labels"]["phase"] == "later"  # type: ignore[index]


def test_a_deletion_older_than_a_recreated_object_keeps_the_new_one() -> None:
    s = store()
    s.observe(pod("p", 20))
    s.forget("Pod", "ns", "p", "15")  # the DELETED event of the previous incarnation
    assert s.get("Pod", "ns", "p") is not None
    s.forget("Pod", "ns", "p", "21")
    assert s.get("Pod", "ns", "p") is None


def test_a_write_answer_read_after_the_deleted_event_does_not_bring_the_object_back() -> None:
    """The DELETE of a Failed pod is immediate: the API server answers the operator and sends the
    DELETED event at once, over two connections. When the event is handled first, the answer (the pod
    as deleted) came back into the store as a ghost no event would ever remove: the gang restart then
    waited for it forever (e2e: `pods: []` after a restart, an engine never replaced)."""
    s = store()
    s.observe(pod("p", 5, uid="u1"))
    s.forget("Pod", "ns", "p", "7", uid="u1")  # the DELETED event
    s.observe(pod("p", 7, uid="u1", copy="delete answer"))  # read after it
    s.observe(pod("p", 6, uid="u1", copy="fresh read"))  # a GET answered before the deletion
    assert s.get("Pod", "ns", "p") is None and s.list("Pod", "ns", f"{JOB}=j") == []
    s.forget("Pod", "ns", "q", "9", uid="u2")  # deleted before its create's answer was read
    s.observe(pod("q", 8, uid="u2"))
    assert s.get("Pod", "ns", "q") is None
    s.observe(pod("p", 12, uid="u3"))  # re-created under the same name: another uid, held
    s.forget("Pod", "ns", "p", "7", uid="u1")  # the old incarnation's DELETED again: keeps the new one
    assert s.get("Pod", "ns", "p")["metadata"]["uid"] == "u3"  # type: ignore[index]


def test_only_what_the_watches_select_is_held_and_reads_are_copies() -> None:
    s = store()
    s.observe(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "other", "namespace": "ns", "labels": {}}}
    )
    s.observe(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "j-config", "namespace": "ns", "labels": {JOB: "j"}},
        }
    )
    s.observe({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "k", "namespace": "ns"}})
    assert len(s) == 0
    s.observe(pod("p", 1))
    copy = s.get("Pod", "ns", "p")
    assert copy is not None
    copy["metadata"]["name"] = "changed"
    assert s.get("Pod", "ns", "p")["metadata"]["name"] == "p"  # type: ignore[index]


def test_lists_match_equality_selectors_per_namespace() -> None:
    s = store()
    s.observe(pod("e0", 1, **{"rl.lockstep.dev/role": "engine"}))
    s.observe(pod("t0", 2, **{"rl.lockstep.dev/role": "trainer"}))
    assert [p["metadata"]["name"] for p in s.list("Pod", "ns", f"{JOB}=j,rl.lockstep.dev/role=engine")] == [
        "e0"
    ]
    assert len(s.list("Pod", "ns", f"{JOB}=j")) == 2 and s.list("Pod", "other", None) == []
    assert s.holds("Pod") and not s.holds("Secret")
    with pytest.raises(ValueError, match="equality"):
        parse_selector("a!=b")


def test_objects_are_held_without_managed_fields() -> None:
    s = store()
    body = pod("p", 1)
    body["metadata"]["managedFields"] = [{"manager": "lockstep-operator", "fieldsV1": {"f:spec": {}}}]
    s.observe(body)
    held = s.get("Pod", "ns", "p")
    assert held is not None and "managedFields" not in held["metadata"]
    assert held["metadata"]["labels"] == {JOB: "j"}
    assert body["metadata"]["managedFields"]  # the caller's object is left as it was


def test_the_echo_of_a_held_version_is_not_copied_again() -> None:
    s = store()
    s.observe(pod("p", 5, copy="answer"))  # our write's answer
    s.observe(pod("p", 5, copy="echo"))  # its watch event: the same version, nothing new
    assert s.get("Pod", "ns", "p")["metadata"]["labels"]["copy"] == "answer"  # type: ignore[index]


def test_lists_by_job_or_pool_follow_label_changes_and_deletions() -> None:
    s = store()
    pool = "rl.lockstep.dev/pool"
    s.observe(pod("e0", 1, **{pool: "a", "rl.lockstep.dev/role": "engine"}))
    s.observe(pod("e1", 2, **{pool: "a", "rl.lockstep.dev/role": "engine"}))
    s.observe(pod("e1", 3, **{pool: "b", "rl.lockstep.dev/role": "engine"}))  # moved to pool b

    def names(selector: str) -> list[str]:
        return [p["metadata"]["name"] for p in s.list("Pod", "ns", selector)]

    assert names(f"{pool}=a,rl.lockstep.dev/role=engine") == ["e0"]
    assert names(f"{pool}=b") == ["e1"] and names(f"{JOB}=j") == ["e0", "e1"]
    s.forget("Pod", "ns", "e0", "1")
    assert names(f"{pool}=a") == [] and names(f"{JOB}=j") == ["e1"]
    assert names("rl.lockstep.dev/role=engine") == ["e1"]  # no indexed label: every pod is looked at


def test_a_relist_drops_what_was_deleted_in_a_watch_gap() -> None:
    """A watch that broke and re-listed (410 Gone) sends nothing for the objects deleted in the gap: the
    store held them for ever (a rank pod deleted then stayed "running" and its gang never restarted).
    A LIST at version 10 that lacks p (held at 5) means p was deleted by then: dropped, returned (its
    reconcile is kicked as by a DELETED event) and buried (a late copy of it is never held again)."""
    s = store()
    s.observe(pod("p", 5, uid="u1"))
    s.observe(pod("q", 6, uid="u2"))
    dropped = s.relisted("Pod", "ns", [pod("q", 6, uid="u2")], "10")
    assert [d["metadata"]["name"] for d in dropped] == ["p"] and dropped[0]["kind"] == "Pod"
    assert s.get("Pod", "ns", "p") is None and [p["metadata"]["name"] for p in s.list("Pod", "ns", None)] == [
        "q"
    ]
    s.observe(pod("p", 5, uid="u1"))  # a copy of the deleted pod read late: stays out
    assert s.get("Pod", "ns", "p") is None
    assert s.relisted("Pod", "ns", [pod("q", 6, uid="u2")], "11") == []  # nothing more to drop


def test_a_relist_never_drops_what_is_newer_than_the_list_nor_revives_what_was_deleted_after_it() -> None:
    """The list is a snapshot at its resourceVersion; events and write answers newer than it may be
    held already when its answer is read. Created after the list (held at 12 > 10): stays. Deleted
    after the list (its DELETED event handled first): not brought back by the listed copy. Modified
    after the list: the listed older copy does not replace it. Missed by the watch: held from the list."""
    s = store()
    s.observe(pod("new", 12, uid="n"))
    s.observe(pod("gone", 4, uid="g"))
    s.forget("Pod", "ns", "gone", "11", uid="g")
    s.observe(pod("changed", 11, uid="c", phase="Running"))
    items = [pod("gone", 4, uid="g"), pod("changed", 7, uid="c", phase="Pending"), pod("missed", 8)]
    assert s.relisted("Pod", "ns", items, "10") == []
    assert s.get("Pod", "ns", "new") is not None and s.get("Pod", "ns", "gone") is None
    assert s.get("Pod", "ns", "changed")["metadata"]["labels"]["phase"] == "Running"  # type: ignore[index]
    assert s.get("Pod", "ns", "missed") is not None
    # re-created under the same name after the list: the old uid listed, the new one held and kept
    s = store()
    s.observe(pod("r", 13, uid="r2"))
    assert s.relisted("Pod", "ns", [pod("r", 9, uid="r1")], "10") == []
    assert s.get("Pod", "ns", "r")["metadata"]["uid"] == "r2"  # type: ignore[index]


def test_a_relist_drops_only_in_its_kind_and_namespace() -> None:
    s = store()
    s.observe(pod("p", 5))
    s.observe({**pod("p", 5), "metadata": {**pod("p", 5)["metadata"], "namespace": "other"}})
    s.observe(
        {"apiVersion": "rl.lockstep.dev/v1alpha1", "kind": "RLJob", "metadata": pod("j", 5)["metadata"]}
    )
    assert [d["metadata"]["namespace"] for d in s.relisted("Pod", "ns", [], "10")] == ["ns"]
    assert s.get("Pod", "other", "p") is not None and s.get("RLJob", "ns", "j") is not None
    assert s.relisted("Pod", None, [], "not-a-number") == []  # no version to compare: nothing dropped
    assert s.get("Pod", "other", "p") is not None
    assert len(s.relisted("Pod", None, [], "10")) == 1  # cluster-wide: every namespace
    assert len(s.relisted("RLJob", None, [], "10")) == 1
    assert len(s) == 0
