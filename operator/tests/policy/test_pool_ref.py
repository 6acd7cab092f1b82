"""pool_ref_problem: a job on a standalone pool fails early when the pool can never serve it, and
waits when a change elsewhere will let it run (the pool created, a job with its adapter name gone)."""

from __future__ import annotations

from typing import Any

import pytest
from lockstep.api.rljob import RLJobSpec
from lockstep.api.rolloutpool import RolloutPoolSpec
from lockstep_operator.policy.pool_ref import PoolRefProblem, PoolUser, pool_ref_problem

T_EARLIER, T0, T1 = "2026-12-05T00:59:00Z", "2026-12-05T01:00:00Z", "2026-12-05T01:00:05Z"


def _job(
    rank: int = 8, ref: str | None = "shared", checkpoint: str = "builtin:tiny", name: str | None = None
) -> RLJobSpec:
    lora: dict[str, Any] = {"rank": rank} | ({"adapterName": name} if name else {})
    rollout: dict[str, Any] = {"engine": "reference", "gpusPerEngine": 0}
    if ref is not None:
        rollout["poolRef"] = {"name": ref}
    return RLJobSpec.model_validate(
        {
            "model": {"checkpoint": checkpoint, "family": "tiny", "lora": lora},
            "rollout": rollout,
            "trainer": {"backend": "fsdp", "device": "cpu", "gpusPerNode": 1},
            "data": {"prompts": "builtin:reverse"},
        }
    )


def _pool(
    rank: int | None = 16, job: str | None = None, checkpoint: str = "builtin:tiny", role: str = "rollout"
) -> RolloutPoolSpec:
    model: dict[str, Any] = {"checkpoint": checkpoint, "family": "tiny"}
    if rank is not None:
        model["lora"] = {"rank": rank}
    return RolloutPoolSpec.model_validate(
        {
            "job": job,
            "role": role,
            "replicas": 1,
            "model": model,
            "engine": {"engine": "reference", "gpusPerEngine": 0},
        }
    )


OTHER_SAME_NAME_FIRST = [PoolUser("b", _job(name="a"), T_EARLIER)]
OTHER_SAME_NAME_LATER = [PoolUser("b", _job(name="a"), T1)]


@pytest.mark.parametrize(
    ("spec", "pool", "others", "waiting", "invalid"),
    [
        (_job(ref=None), None, [], None, None),  # no poolRef: nothing to check
        (_job(), _pool(), [], None, None),
        (_job(rank=16), _pool(rank=16), [], None, None),  # the pool's rank is the largest it serves
        (_job(), None, [], "RolloutPool shared does not exist in namespace ns: create it", None),
        (_job(), _pool(job="owner"), [], None, "belongs to RLJob owner; reference a standalone pool"),
        (_job(), _pool(role="teacher"), [], None, "is a teacher pool (spec.role teacher)"),
        (_job(), _pool(checkpoint="/models/other"), [], None, "serves /models/other, this job's model.checkpoint is builtin:tiny"),
        (_job(rank=32), _pool(rank=16), [], None, "model.lora.rank 32 is above what RolloutPool shared serves: --max-lora-rank 16"),
        (_job(rank=4), _pool(rank=None), [], None, "serves: no LoRA (no model.lora)"),
        (_job(), _pool(), OTHER_SAME_NAME_FIRST, "RLJob b loads adapters of that name on RolloutPool shared", None),
        (_job(), _pool(), OTHER_SAME_NAME_LATER, None, None),  # created after this job: it waits, not this one
        (_job(), _pool(), [PoolUser("b", _job(), T0)], None, None),  # its adapter is named b
        (_job(), _pool(), [PoolUser("b", _job(ref="elsewhere", name="a"), T0)], None, None),  # another pool
    ],
    ids=[
        "no-pool-ref", "fits", "rank-equal", "pool-missing", "pool-of-a-job", "teacher-pool", "other-checkpoint",
        "rank-above-max-lora-rank", "pool-without-lora", "adapter-name-taken-first", "adapter-name-taken-later",
        "other-adapter-name", "other-pool",
    ],
)  # fmt: skip
def test_pool_ref_problem_table(
    spec: RLJobSpec,
    pool: RolloutPoolSpec | None,
    others: list[PoolUser],
    waiting: str | None,
    invalid: str | None,
) -> None:
    got = pool_ref_problem(spec, "a", T0, pool, others, namespace="ns")
    assert (got.waiting is None) == (waiting is None), got
    assert (got.invalid is None) == (invalid is None), got
    if waiting:
        assert waiting in (got.waiting or ""), got
    if invalid:
        assert invalid in (got.invalid or ""), got


def test_two_jobs_with_one_adapter_name_never_wait_for_each_other() -> None:
    a, b = PoolUser("a", _job(name="x"), T0), PoolUser("b", _job(name="x"), T0)  # same second: by name
    got_a = pool_ref_problem(a.spec, a.name, a.created, _pool(), [a, b], namespace="ns")
    got_b = pool_ref_problem(b.spec, b.name, b.created, _pool(), [a, b], namespace="ns")
    assert got_a == PoolRefProblem() and got_b.waiting is not None and "RLJob a" in got_b.waiting


def test_a_job_created_again_waits_until_its_predecessors_unload_pod_is_gone() -> None:
    """RLJob a deleted, the pool's unload pod of adapter a still there (running, or terminating), a
    created again: the pod unloads every a-v<N> it finds, the new job's too, so the new job waits
    naming the pod; the pool deletes the pod once a live job uses the name, and the job then runs.
    Another adapter name never waits; a problem that fails the job still fails it."""
    unloading = {"a": "shared-unload-0123456789"}
    got = pool_ref_problem(_job(), "a", T0, _pool(), [], namespace="ns", unloading=unloading)
    assert got.invalid is None and "pod shared-unload-0123456789 still unloads" in (got.waiting or ""), got
    assert got.reason == "AdapterUnloading", got
    other = pool_ref_problem(_job(name="b"), "a", T0, _pool(), [], namespace="ns", unloading=unloading)
    assert other == PoolRefProblem()
    assert pool_ref_problem(_job(), "a", T0, _pool(), [], namespace="ns", unloading={}) == PoolRefProblem()
    too_big = pool_ref_problem(
        _job(rank=32), "a", T0, _pool(rank=16), [], namespace="ns", unloading=unloading
    )
    assert too_big.invalid is not None


@pytest.mark.parametrize(
    ("pool", "others", "reason"),
    [
        (None, [], "PoolNotFound"),
        (_pool(), OTHER_SAME_NAME_FIRST, "AdapterNameInUse"),
    ],
    ids=["pool-missing", "adapter-name-taken"],
)
def test_each_wait_names_its_own_reason(
    pool: RolloutPoolSpec | None, others: list[PoolUser], reason: str
) -> None:
    """The condition's reason says which wait it is (a user filters on it), not PoolNotFound for all."""
    got = pool_ref_problem(_job(), "a", T0, pool, others, namespace="ns")
    assert got.waiting is not None and got.reason == reason, got
