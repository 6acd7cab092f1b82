"""A deleted or ended job's adapter leaves a standalone pool's engines (policy and pod, pure).

What must hold: the pool remembers the adapter name of every job that used it; a name leaves the engines
once no job that has not ended uses it (deleted, deleting, Succeeded, Failed), never while one does
(the same name used again by a new job); other pools' jobs and jobs without LoRA count for nothing. The
unload pod runs `lockstep unload-adapter NAME --engine URL...` against the serving engines, carries the
label the pool's NetworkPolicy admits and the pool's API key from its Secret, and is selected by none
of the pool's engine selectors (its Services, its engine list).
"""

from __future__ import annotations

from typing import Any

from lockstep_operator.policy.adapter_gc import plan, recorded
from lockstep_operator.resources.adapter_gc import unload_pod, unload_pod_name
from lockstep_operator.resources.common import API_KEY_ITEM, LABEL_POOL_CLIENT, Owner, api_key_secret_name
from lockstep_operator.resources.network import shared_engine_network_policy
from lockstep_operator.resources.pods import selector_labels

POOL = Owner("rl.lockstep.dev/v1alpha1", "RolloutPool", "shared", "uid-p", "ns")


def _job(name: str, *, pool: str = "shared", phase: str | None = "Running", adapter: str | None = None,
         lora: bool = True, deleting: bool = False) -> dict[str, Any]:  # fmt: skip
    lora_spec: dict[str, Any] = {"rank": 4, **({"adapterName": adapter} if adapter else {})}
    meta: dict[str, Any] = {
        "name": name,
        **({"deletionTimestamp": "2026-12-05T00:00:00Z"} if deleting else {}),
    }
    return {
        "metadata": meta,
        "spec": {"model": {"lora": lora_spec} if lora else {}, "rollout": {"poolRef": {"name": pool}}},
        "status": {"phase": phase} if phase else {},
    }


def test_live_jobs_are_remembered_and_none_of_their_adapters_leave() -> None:
    p = plan(
        set(), [_job("a"), _job("b", phase=None), _job("c", phase="Suspended", adapter="mine")], "shared"
    )
    assert p.record == {"a", "b", "mine"} and p.stale == set()


def test_a_deleted_or_ended_jobs_adapter_leaves_and_no_other() -> None:
    jobs = [_job("a"), _job("b", phase="Succeeded"), _job("c", phase="Failed"), _job("d", deleting=True)]
    p = plan({"a", "gone"}, jobs, "shared")  # "gone": a job deleted while nothing ran this step
    assert p.stale == {"b", "c", "d", "gone"} and p.record == {"a", "b", "c", "d", "gone"}


def test_a_name_used_again_by_a_live_job_never_leaves() -> None:
    # reverse-c deleted, created again (or another job with adapterName reverse-c) before the cleanup
    p = plan({"reverse-c"}, [_job("other", adapter="reverse-c"), _job("reverse-c", phase="Failed")], "shared")
    assert p.stale == set()


def test_other_pools_and_jobs_without_lora_count_for_nothing() -> None:
    p = plan(
        set(), [_job("x", pool="elsewhere", phase="Failed"), _job("y", lora=False, phase="Failed")], "shared"
    )
    assert p.record == set() and p.stale == set()


def test_an_unreadable_annotation_reads_as_no_names() -> None:
    assert recorded(None) == set() and recorded("{") == set() and recorded('{"a": 1}') == set()
    assert recorded('["a", "b"]') == {"a", "b"}


def _engine(ip: str) -> dict[str, Any]:
    return {
        "spec": {
            "nodeSelector": {"lockstep.dev/node": "real"},
            "tolerations": [{"key": "lockstep.dev/node", "operator": "Exists"}],
            "affinity": {"podAntiAffinity": {"x": 1}, "nodeAffinity": {"y": 2}},
        },
        "status": {"podIP": ip},
    }


def test_the_unload_pod_reaches_the_engines_as_a_pool_client_with_the_pools_key() -> None:
    pod = unload_pod(
        POOL,
        pool="shared",
        adapter="reverse-c",
        engines=[_engine("10.0.0.2"), _engine("10.0.0.1")],
        image="rt:1",
    )
    assert pod["metadata"]["name"] == unload_pod_name("shared", "reverse-c")
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-p"
    main = pod["spec"]["containers"][0]
    assert main["command"] == ["lockstep", "unload-adapter", "reverse-c",
                               "--engine", "http://10.0.0.1:30000", "--engine", "http://10.0.0.2:30000"]  # fmt: skip
    ref = main["env"][0]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": api_key_secret_name("shared"), "key": API_KEY_ITEM}
    assert pod["spec"]["restartPolicy"] == "Never" and pod["spec"]["automountServiceAccountToken"] is False
    # deleted (its name used again), it stops at once: PID 1 ignores SIGTERM, a job waits for it to go
    assert pod["spec"]["terminationGracePeriodSeconds"] == 1
    # placed where the engines may run, but never with their pod (anti-)affinity
    assert pod["spec"]["affinity"] == {"nodeAffinity": {"y": 2}}
    assert pod["spec"]["tolerations"] == [{"key": "lockstep.dev/node", "operator": "Exists"}]
    labels = pod["metadata"]["labels"]
    admitted = shared_engine_network_policy(POOL, pool="shared")["spec"]["ingress"][0]["from"][0][
        "podSelector"
    ]
    assert admitted["matchLabels"] == {LABEL_POOL_CLIENT: "shared"}
    assert labels[LABEL_POOL_CLIENT] == "shared"
    engines = selector_labels("shared", pool="shared")
    assert not all(labels.get(k) == v for k, v in engines.items())  # not an engine of the pool
