"""The operator's side of on-policy distillation and SFT jobs (no cluster; pure builders and policies).

- a checkpoint teacher gets a RolloutPool of role teacher (its checkpoint, the rollout's engine settings),
  a url teacher none; the driver pod learns each teacher pool's router URL (LOCKSTEP_TEACHER_URLS);
- an SFT job has no pool and no channel: it is not Pending for want of a pool, its gang has no engines,
  and its WeightChannelReady condition says why it has none;
- a job waits (Provisioning) until its teacher pools serve, naming the teacher;
- a poolRef teacher (a standalone pool of role teacher): the driver reads it at its router with the
  pool's own key (LOCKSTEP_TEACHER_API_KEY_<NAME> from the pool's Secret) and carries the label the
  pool's NetworkPolicy admits, on the HTTP port only; the job fails when the pool is another job's or
  of role rollout (a rollout pool is updated), and waits while it does not exist.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from lockstep.api.progress import ProgressReport
from lockstep.api.rljob import Phase, RLJobSpec
from lockstep.api.rolloutpool import RolloutPoolSpec, RolloutPoolStatus
from lockstep_operator.policy.job_conditions import admitted, weight_channel_ready
from lockstep_operator.policy.job_observed import JobObserved
from lockstep_operator.policy.job_phase import job_phase
from lockstep_operator.policy.teacher_pools import teacher_pool_problem
from lockstep_operator.resources.children import teacher_pool_manifests
from lockstep_operator.resources.common import Owner
from lockstep_operator.resources.driver import driver_manifest
from lockstep_operator.resources.network import shared_engine_network_policy
from lockstep_operator.resources.podgroups import gang_min_member
from policy.policy_fixtures import job_spec, seen

OWNER = Owner(
    api_version="rl.lockstep.dev/v1alpha1", kind="RLJob", name="tiny-local", uid="u", namespace="ns"
)
OPD: dict[str, Any] = {
    "teachers": [
        {"name": "math", "checkpoint": "/models/teacher", "labels": ["reverse"], "replicas": 2},
        {"name": "ext", "url": "http://teacher.example:30000", "labels": ["other"]},
    ]
}


def _opd_spec(opd: dict[str, Any] = OPD) -> RLJobSpec:
    spec = job_spec()
    algorithm = spec.algorithm.model_copy(update={"opd": spec.algorithm.__class__.model_validate(
        {**spec.algorithm.wire(), "opd": opd}).opd})  # fmt: skip
    return spec.model_copy(update={"algorithm": algorithm})


POOL_REF = {"teachers": [{"name": "big-math", "poolRef": {"name": "tutors"}, "labels": ["reverse"]}]}


def test_a_checkpoint_teacher_gets_a_teacher_pool_and_a_url_teacher_none() -> None:
    [pool] = teacher_pool_manifests(OWNER, _opd_spec(), suspended=False, stopped="")
    assert pool["kind"] == "RolloutPool" and pool["metadata"]["name"] == "tiny-local-teacher-math"
    spec = RolloutPoolSpec.model_validate(pool["spec"])
    assert spec.role.value == "teacher" and spec.job == "tiny-local"
    assert spec.model.checkpoint == "/models/teacher" and spec.model.family == "tiny"
    assert spec.engine.engine.value == "reference" and "replicas" not in pool["spec"]  # /scale owns it
    assert pool["metadata"]["annotations"]["rl.lockstep.dev/job-replicas"] == "2"


def test_the_driver_learns_where_each_served_teacher_is() -> None:
    pod = driver_manifest(OWNER, _opd_spec(), image="img")
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert json.loads(env["LOCKSTEP_TEACHER_URLS"]) == {"math": "http://tiny-local-teacher-math-router:30000"}
    plain = driver_manifest(OWNER, job_spec(), image="img")
    assert "LOCKSTEP_TEACHER_URLS" not in {e["name"] for e in plain["spec"]["containers"][0]["env"]}


def _sft() -> RLJobSpec:
    return job_spec(
        recipe="sft",
        algorithm={"batchSize": 8, "learningRate": 1e-3},
        weightSync={"checkWeightUpdateEqual": False},
        schedule={"steps": 10},
    )


def test_an_sft_job_runs_without_a_pool() -> None:
    spec = _sft()
    no_pool = seen(engines=None)
    assert job_phase(spec, no_pool, None).phase is Phase.PREFLIGHT  # waits for the driver's init only
    started = JobObserved(**{**_fields(no_pool), "progress": ProgressReport(step=0)})
    assert job_phase(spec, started, Phase.PREFLIGHT).phase is Phase.RUNNING
    assert job_phase(job_spec(), no_pool, None).phase is Phase.PENDING  # an RL job needs its pool
    assert gang_min_member(spec) == 1  # the one rank, no engine
    update = weight_channel_ready(no_pool, spec)
    assert update.status is None and update.reason == "NoEngines"


def test_a_job_waits_for_its_teacher_pools_naming_them() -> None:
    spec = _opd_spec()
    waiting = JobObserved(**{**_fields(seen()), "teacher_pools": {"tiny-local-teacher-math": None}})
    verdict = job_phase(spec, waiting, None)
    assert (
        verdict.phase is Phase.PROVISIONING
        and "teacher tiny-local-teacher-math engines ready 0/1" in verdict.message
    )
    ready = RolloutPoolStatus(replicas=2, ready_replicas=2)
    served = JobObserved(**{**_fields(seen()), "teacher_pools": {"tiny-local-teacher-math": ready}})
    assert job_phase(spec, served, None).phase is not Phase.PROVISIONING


def _fields(obs: JobObserved) -> dict[str, Any]:
    return {name: getattr(obs, name) for name in JobObserved.__dataclass_fields__}


def test_a_pool_ref_teacher_is_read_with_its_pools_key_through_its_policy() -> None:
    pod = driver_manifest(OWNER, _opd_spec(POOL_REF), image="img")
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}
    assert json.loads(env["LOCKSTEP_TEACHER_URLS"]) == {"big-math": "http://tutors-router:30000"}
    assert env["LOCKSTEP_TEACHER_API_KEY_BIG_MATH"] == {
        "secretKeyRef": {"name": "tutors-api-key", "key": "api-key"}
    }
    assert (
        env["LOCKSTEP_API_KEY"]["secretKeyRef"]["name"] == "tiny-local-api-key"
    )  # its own engines: the job's
    assert pod["metadata"]["labels"]["teacher-client.rl.lockstep.dev/tutors"] == "true"
    assert (
        teacher_pool_manifests(OWNER, _opd_spec(POOL_REF), suspended=False, stopped="") == []
    )  # not the job's
    owner = Owner("rl.lockstep.dev/v1alpha1", "RolloutPool", "tutors", "uid-p", "ns")
    policy = shared_engine_network_policy(owner, pool="tutors", teacher=True)["spec"]
    readers, engines, scrape = policy["ingress"]
    assert scrape == {"ports": [{"protocol": "TCP", "port": 9400}]}  # Prometheus: the metrics port only
    assert readers == {
        "from": [{"podSelector": {"matchLabels": {"teacher-client.rl.lockstep.dev/tutors": "true"}}}],
        "ports": [{"protocol": "TCP", "port": 30000}],  # scoring only: nothing writes to a teacher
    }
    assert engines["from"] == [{"podSelector": {"matchLabels": policy["podSelector"]["matchLabels"]}}]
    rollout = shared_engine_network_policy(owner, pool="tutors")["spec"]["ingress"]  # a LoRA jobs' pool
    assert rollout[0]["from"][0] == {
        "podSelector": {"matchLabels": {"rl.lockstep.dev/pool-client": "tutors"}}
    }


def _pool(job: str | None = None, role: str = "teacher") -> RolloutPoolSpec:
    model = {"checkpoint": "/models/teacher", "family": "tiny"}
    return RolloutPoolSpec.model_validate({"job": job, "role": role, "model": model})


WHERE = "spec.algorithm.opd.teachers[big-math].poolRef: RolloutPool tutors"


@pytest.mark.parametrize(
    ("pool", "waiting", "invalid"),
    [
        (_pool(), None, None),
        (
            None,
            f"{WHERE} does not exist in namespace ns: create it (spec.role teacher, spec.job unset)",
            None,
        ),
        (_pool(job="other"), None, f"{WHERE} belongs to RLJob other; reference a standalone teacher pool"),
        (_pool(role="rollout"), None, f"{WHERE} has spec.role rollout: the jobs on a rollout pool update"),
    ],
    ids=["a-standalone-teacher-pool", "absent-waits", "another-jobs-pool", "a-rollout-pool"],
)
def test_which_pools_may_teach(
    pool: RolloutPoolSpec | None, waiting: str | None, invalid: str | None
) -> None:
    got_waiting, got_invalid = teacher_pool_problem(_opd_spec(POOL_REF), {"tutors": pool}, "ns")
    assert (got_waiting, got_invalid is None) == (waiting, invalid is None)
    assert invalid is None or (got_invalid or "").startswith(invalid)
    assert teacher_pool_problem(_opd_spec(), {}, "ns") == (None, None)  # checkpoint and url teachers


def test_a_job_waits_pending_for_a_pool_it_names_naming_it() -> None:
    missing = f"{WHERE} does not exist in namespace ns: create it (spec.role teacher, spec.job unset)"
    obs = JobObserved(**{**_fields(seen(ranks=None, engines=None, driver=None)), "missing_pool": missing})
    verdict = job_phase(_opd_spec(POOL_REF), obs, None)
    assert (verdict.phase, verdict.reason, verdict.message) == (Phase.PENDING, "PoolNotFound", missing)
    update = admitted(_opd_spec(POOL_REF), obs)
    assert (update.status, update.reason, update.message) == (False, "PoolNotFound", missing)


def test_a_wait_for_an_adapter_name_keeps_its_reason() -> None:
    """A job on a pool still unloading its predecessor's adapter waits under AdapterUnloading, in the
    phase and in Admitted alike (policy.pool_ref names the wait)."""
    why = "model.lora.adapterName a: pod shared-unload-0123 still unloads ..."
    fields = _fields(seen(ranks=None, engines=None, driver=None))
    obs = JobObserved(**{**fields, "missing_pool": why, "missing_pool_reason": "AdapterUnloading"})
    verdict = job_phase(_opd_spec(POOL_REF), obs, None)
    assert (verdict.phase, verdict.reason) == (Phase.PENDING, "AdapterUnloading")
    assert admitted(_opd_spec(POOL_REF), obs).reason == "AdapterUnloading"
