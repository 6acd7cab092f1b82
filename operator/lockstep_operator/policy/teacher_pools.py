"""Whether the standalone pools a job's teachers name can teach it (algorithm.opd.teachers[].poolRef).

Why it exists: a teacher is never updated (§8.1; docs/distillation.md). A standalone RolloutPool of role
teacher (spec.job unset, spec.role teacher) is one no job updates: the operator gives its engines no
weight path and admits its readers on the HTTP port only. A pool of role rollout is updated by the LoRA
jobs on it, another job's pool belongs to that job (and goes with it): neither may teach. A pool that
does not exist yet may still be created, so the job waits for it. The RLJob reconcile reads the pools
and asks this pure function; the same rule, seen from the other side, keeps rollout.poolRef off a
teacher pool (reconcile.rljob).

Who calls it: lockstep_operator.reconcile.rljob (before any child is created).
"""

from __future__ import annotations

from collections.abc import Mapping

from lockstep.api.rljob import RLJobSpec, standalone_teachers
from lockstep.api.rolloutpool import PoolRole, RolloutPoolSpec


def teacher_pool_problem(
    spec: RLJobSpec, pools: Mapping[str, RolloutPoolSpec | None], namespace: str
) -> tuple[str | None, str | None]:
    """(waiting, invalid) for the job's poolRef teachers, given each named pool's spec (None: absent).

    invalid (the job fails, naming the teacher and the fix): a pool that belongs to a job, a pool of role
    rollout; waiting (the job stays Pending, saying so): a pool that does not exist. (None, None) when
    every poolRef teacher names a standalone teacher pool, or there are none."""
    waiting: str | None = None
    for teacher, name in standalone_teachers(spec).items():
        where = f"spec.algorithm.opd.teachers[{teacher}].poolRef"
        pool = pools.get(name)
        if pool is None:
            waiting = waiting or (
                f"{where}: RolloutPool {name} does not exist in namespace {namespace}: create it "
                "(spec.role teacher, spec.job unset)"
            )
        elif pool.job is not None:
            return None, (
                f"{where}: RolloutPool {name} belongs to RLJob {pool.job}; reference a standalone teacher "
                "pool (spec.job unset, spec.role teacher) or give the teacher a checkpoint (the operator "
                "runs its pool)"
            )
        elif pool.role is not PoolRole.TEACHER:
            return None, (
                f"{where}: RolloutPool {name} has spec.role {pool.role.value}: the jobs on a rollout pool "
                "update its engines and a teacher is never updated: reference a pool with spec.role teacher"
            )
    return waiting, None
