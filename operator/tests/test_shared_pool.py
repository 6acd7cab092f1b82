"""LoRA jobs on a standalone RolloutPool (rollout.poolRef): what the operator renders for them.

A standalone pool (spec.job unset) is created by a user and owned by no job; jobs use it through
rollout.poolRef. Its engines carry the pool's own name as their job label, read the pool's own API
key, serve LoRA (model.lora -> SGLang's --enable-lora flags) and admit the driver and trainer pods of
the jobs that use it (label pool-client). A job on it creates no pool, counts no engines in its gang,
points its WeightChannel, driver and ranks at that pool.
"""

from __future__ import annotations

from typing import Any

from lockstep.api.rljob import RLJob
from lockstep.api.rolloutpool import RolloutPoolSpec
from lockstep.api.trainergroup import TrainerGroupSpec
from lockstep_operator.resources.annotations import Annotation
from lockstep_operator.resources.children import child_manifests
from lockstep_operator.resources.common import LABEL_POOL_CLIENT, Owner
from lockstep_operator.resources.driver import driver_manifest
from lockstep_operator.resources.engines import engine_manifest
from lockstep_operator.resources.network import shared_engine_network_policy, trainer_network_policy
from lockstep_operator.resources.podgroups import gang_min_member
from lockstep_operator.resources.ranks import rank_manifest
from lockstep_operator.topology import NETWORK_LABEL, ZONE_LABEL

JOB = Owner("rl.lockstep.dev/v1alpha1", "RLJob", "job-a", "uid-a", "ns")
POOL = Owner("rl.lockstep.dev/v1alpha1", "RolloutPool", "shared", "uid-p", "ns")


def _job(pool_ref: bool = True) -> RLJob:
    spec: dict[str, Any] = {
        "model": {"checkpoint": "builtin:tiny", "family": "tiny", "lora": {"rank": 4}},
        "rollout": {"engine": "reference", "gpusPerEngine": 0, "replicas": 3},
        "trainer": {"backend": "fsdp", "device": "cpu", "gpusPerNode": 1, "nodes": 2},
        "data": {"prompts": "builtin:reverse"},
    }
    if pool_ref:
        spec["rollout"]["poolRef"] = {"name": "shared"}
    return RLJob.model_validate({"metadata": {"name": "job-a"}, "spec": spec})


def _env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


def test_a_job_on_a_shared_pool_points_its_children_at_it() -> None:
    job = _job()
    _pool, trainer, channel = child_manifests(JOB, job.spec, suspended=False, stopped="")
    assert channel["spec"]["rolloutPool"] == "shared"
    assert trainer["metadata"]["annotations"][Annotation.SHARED_POOL.value] == "shared"
    assert gang_min_member(job.spec) == 2  # the ranks only: the pool's engines are not the job's
    assert gang_min_member(_job(pool_ref=False).spec) == 2 + 3
    own = child_manifests(JOB, _job(pool_ref=False).spec, suspended=False, stopped="")
    assert own[2]["spec"]["rolloutPool"] == "job-a-rollout"
    assert Annotation.SHARED_POOL.value not in own[1]["metadata"]["annotations"]


def test_the_driver_and_ranks_reach_the_shared_pool_with_its_key() -> None:
    job = _job()
    driver = driver_manifest(JOB, job.spec, image="img")
    env = _env(driver)
    assert env["LOCKSTEP_ROUTER_URL"] == "http://shared-router:30000"
    assert env["LOCKSTEP_ENGINES_SERVICE"] == "shared-engines"
    assert env["LOCKSTEP_API_KEY"]["secretKeyRef"]["name"] == "shared-api-key"
    assert driver["metadata"]["labels"][LABEL_POOL_CLIENT] == "shared"
    group = TrainerGroupSpec.model_validate(
        {"job": "job-a", "model": job.spec.model.wire(), "trainer": job.spec.trainer.wire()}
    )
    owner = Owner("rl.lockstep.dev/v1alpha1", "TrainerGroup", "job-a-trainer", "uid-t", "ns")
    rank = rank_manifest(
        owner, group, 0, generation=0, gang_min=2, clique=None, image="img", shared_pool="shared"
    )
    env = _env(rank)
    assert env["LOCKSTEP_ENGINES_SERVICE"] == "shared-engines"
    assert env["LOCKSTEP_API_KEY"]["secretKeyRef"]["name"] == "shared-api-key"
    assert rank["metadata"]["labels"][LABEL_POOL_CLIENT] == "shared"
    own = rank_manifest(owner, group, 0, generation=0, gang_min=2, clique=None, image="img")
    assert _env(own)["LOCKSTEP_ENGINES_SERVICE"] == "job-a-rollout-engines"
    assert LABEL_POOL_CLIENT not in own["metadata"]["labels"]


def test_a_standalone_pools_engines_serve_lora_under_the_pools_own_name() -> None:
    spec = RolloutPoolSpec.model_validate(
        {
            "model": {"checkpoint": "builtin:tiny", "family": "tiny", "lora": {"rank": 8}},
            "engine": {"engine": "reference", "gpusPerEngine": 0},
            "replicas": 2,
        }
    )
    assert spec.job is None
    pod = engine_manifest(POOL, spec, 0, gang_min=0, image="img")
    cmd = pod["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--max-lora-rank") + 1] == "8" and "--enable-lora" in cmd
    assert pod["metadata"]["labels"]["rl.lockstep.dev/job"] == "shared"
    assert _env(pod)["LOCKSTEP_API_KEY"]["secretKeyRef"]["name"] == "shared-api-key"
    policy = shared_engine_network_policy(POOL, pool="shared")
    assert policy["spec"]["podSelector"]["matchLabels"]["rl.lockstep.dev/pool"] == "shared"
    sources = [f["podSelector"]["matchLabels"] for f in policy["spec"]["ingress"][0]["from"]]
    assert {LABEL_POOL_CLIENT: "shared"} in sources
    # the trainer's policy lets the shared pool's engines in (their job label is the pool's name)
    tp = trainer_network_policy(JOB, job="job-a", trainer="job-a-trainer", pool="shared", pool_job="shared")
    engines = tp["spec"]["ingress"][1]["from"][1]["podSelector"]["matchLabels"]
    assert engines["rl.lockstep.dev/job"] == "shared" and engines["rl.lockstep.dev/pool"] == "shared"


def _near(pod: dict[str, Any]) -> set[tuple[tuple[tuple[str, str], ...], str]]:
    """The pod's preferred pod-affinity terms as (selected labels, topology key)."""
    terms = pod["spec"]["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    return {
        (tuple(sorted(t["podAffinityTerm"]["labelSelector"]["matchLabels"].items())), t["podAffinityTerm"]["topologyKey"])
        for t in terms
    }  # fmt: skip


def test_engines_and_ranks_prefer_the_network_domain_of_the_pods_they_sync_with() -> None:
    """A job's ranks prefer the network domain (the network label, else the zone: what the transport
    choice compares) of the engines they update and of each other; a job's own engines that of its
    ranks and their pool; a standalone pool's engines that of their pool only (its jobs' ranks follow)."""
    keys = (NETWORK_LABEL, ZONE_LABEL)
    engines = (("rl.lockstep.dev/pool", "job-a-rollout"), ("rl.lockstep.dev/role", "engine"))
    shared = (("rl.lockstep.dev/pool", "shared"), ("rl.lockstep.dev/role", "engine"))
    ranks = (("rl.lockstep.dev/job", "job-a"), ("rl.lockstep.dev/role", "trainer"))
    group = TrainerGroupSpec.model_validate(
        {"job": "job-a", "model": _job().spec.model.wire(), "trainer": _job().spec.trainer.wire()}
    )
    owner = Owner("rl.lockstep.dev/v1alpha1", "TrainerGroup", "job-a-trainer", "uid-t", "ns")
    own = rank_manifest(owner, group, 0, generation=0, gang_min=2, clique=None, image="img")
    assert _near(own) == {(s, k) for s in (engines, ranks) for k in keys}
    on_shared = rank_manifest(
        owner, group, 1, generation=0, gang_min=2, clique=None, image="img", shared_pool="shared"
    )
    assert _near(on_shared) == {(s, k) for s in (shared, ranks) for k in keys}
    pool, _trainer, _channel = child_manifests(JOB, _job(pool_ref=False).spec, suspended=False, stopped="")
    pool_owner = Owner("rl.lockstep.dev/v1alpha1", "RolloutPool", "job-a-rollout", "uid-r", "ns")
    engine = engine_manifest(
        pool_owner, RolloutPoolSpec.model_validate(pool["spec"]), 0, gang_min=1, image="img"
    )
    assert _near(engine) == {(s, k) for s in (engines, ranks) for k in keys}
    standalone = RolloutPoolSpec.model_validate(
        {
            "model": {"checkpoint": "builtin:tiny", "family": "tiny"},
            "engine": {"engine": "reference", "gpusPerEngine": 0},
        }
    )
    assert _near(engine_manifest(POOL, standalone, 0, gang_min=0, image="img")) == {(shared, k) for k in keys}
