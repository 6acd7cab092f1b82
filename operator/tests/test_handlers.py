"""The kopf registrations: only event and index handlers, which is what lets the operator skip kopf's
per-event diff base (handlers.EventOnlyDiffBase). Imports the handlers module, starts nothing."""

from __future__ import annotations

import asyncio
import inspect
import types

import kopf
import lockstep_operator.handlers as handlers
from lockstep_operator.k8s.store import Store
from lockstep_operator.workqueue import Key, WorkQueue


def test_no_change_or_daemon_handlers_so_the_diff_base_may_be_empty() -> None:
    registry = kopf.get_default_registry()
    changing = [h.id for h in registry._changing.get_all_handlers()]
    spawning = [h.id for h in registry._spawning.get_all_handlers()]
    assert not changing and not spawning, (
        f"kopf change/daemon handlers {changing + spawning} need kopf's diff base: "
        "drop handlers.EventOnlyDiffBase from startup() or use an on.event handler"
    )
    assert len(registry._watching.get_all_handlers()) >= 6  # the event handlers are registered


def test_the_diff_base_is_empty_for_any_body() -> None:
    body = kopf.Body({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"a": 1}})
    assert handlers.EventOnlyDiffBase(prefix="rl.lockstep.dev").build(body=body) == {}


def test_every_handler_runs_on_the_event_loop() -> None:
    """kopf runs a plain function in a worker thread: the store would change under a pass reading it."""
    registry = kopf.get_default_registry()
    handlers_ = [*registry._indexing.get_all_handlers(), *registry._watching.get_all_handlers()]
    threaded = [h.id for h in handlers_ if not inspect.iscoroutinefunction(h.fn)]
    assert not threaded, f"handlers {threaded} would run in kopf's thread pool: make them `async def`"


async def test_a_deleted_pods_late_copy_never_comes_back_into_the_store() -> None:
    """The pod handler hands the DELETED event's uid to the store: the answer of the operator's own
    DELETE, read after the event, is then refused (a ghost rank stalled a gang restart for ever)."""
    labels = {"rl.lockstep.dev/job": "j", "rl.lockstep.dev/role": "trainer"}
    raw = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "j-trainer-0",
            "namespace": "ns",
            "uid": "u1",
            "resourceVersion": "7",
            "labels": labels,
        },
    }
    store = Store({"Pod": {"rl.lockstep.dev/job": None}})
    store.observe(raw)
    ran: list[Key] = []

    async def run(key: Key) -> None:
        ran.append(key)

    memo = kopf.Memo(store=store, queue=WorkQueue(run))
    await handlers.pod_event(type="DELETED", namespace="ns", labels=labels, body=kopf.Body(raw), memo=memo)
    store.observe(raw)  # the DELETE's answer
    assert store.get("Pod", "ns", "j-trainer-0") is None
    await memo["queue"].close()


async def test_a_pod_a_relist_found_gone_is_handled_as_its_deleted_event() -> None:
    """A rank pod deleted while the pod watch was broken (k8s/relist.py): the cache's re-list drops it
    and its gang's TrainerGroup is reconciled, as its DELETED event would have made it."""
    labels = {
        "rl.lockstep.dev/job": "j",
        "rl.lockstep.dev/role": "trainer",
        "rl.lockstep.dev/trainer": "j-trainer",
    }
    meta = {"name": "j-trainer-0", "namespace": "ns", "uid": "u1", "resourceVersion": "7", "labels": labels}
    store = Store({"Pod": {"rl.lockstep.dev/job": None}})
    store.observe({"apiVersion": "v1", "kind": "Pod", "metadata": meta})
    ran: list[Key] = []

    async def run(key: Key) -> None:
        ran.append(key)

    memo = kopf.Memo(store=store, queue=WorkQueue(run))
    for body in store.relisted("Pod", "ns", [], "9"):  # a list at 9 without it
        await handlers._gone(memo, body)
    for _ in range(500):  # the queue runs the kicked keys on its own tasks
        if len(ran) >= 2:
            break
        await asyncio.sleep(0.01)
    assert sorted(ran) == [("TrainerGroup", "ns", "j-trainer"), ("WeightChannel", "ns", "j-weights")]
    assert store.get("Pod", "ns", "j-trainer-0") is None
    await memo["queue"].close()


async def test_a_childs_event_echoing_the_operators_own_write_passes_only_its_job() -> None:
    """A child the operator created or changed was kicked by the write itself (KubeClient.on_write):
    its ADDED or MODIFIED event of that version passes only its job (which folds the child's status);
    an event of any other version (a user's edit) passes the child too."""
    ran: list[Key] = []

    async def run(key: Key) -> None:
        ran.append(key)

    async def kicked(event: str, version: str) -> list[Key]:
        ran.clear()
        meta = {"name": "j-rollout", "namespace": "ns", "uid": "u", "resourceVersion": version}
        body = {"apiVersion": "rl.lockstep.dev/v1alpha1", "kind": "RolloutPool", "metadata": meta,
                "spec": {"job": "j"}}  # fmt: skip
        await handlers._CHILDREN["RolloutPool"](
            type=event, name="j-rollout", namespace="ns", body=kopf.Body(body), memo=memo
        )
        for _ in range(500):  # the queue runs the kicked keys on its own tasks
            if memo["queue"].in_flight == 0:
                break
            await asyncio.sleep(0.01)
        return sorted(ran)

    kube = types.SimpleNamespace(written={("RolloutPool", "ns", "j-rollout"): "5"})
    memo = kopf.Memo(store=Store(), queue=WorkQueue(run), kube=kube)
    job, pool = ("RLJob", "ns", "j"), ("RolloutPool", "ns", "j-rollout")
    assert await kicked("ADDED", "5") == [job]
    assert await kicked("MODIFIED", "5") == [job]
    assert await kicked("MODIFIED", "6") == [job, pool]
    assert await kicked(None, "5") == [job, pool]  # a listing: not taken for an echo
    await memo["queue"].close()
