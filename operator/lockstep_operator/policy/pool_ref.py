"""Whether a standalone RolloutPool can serve a job that references it (pure; table-tested).

Why: several RLJobs train their own LoRA adapters on one user-created pool (rollout.poolRef,
docs/lora.md). What the pool serves is fixed by the pool, not the job, so a job the pool cannot
serve must fail before it starts anything, naming both sides and the fix: a pool that belongs to
another job, a teacher pool, another base checkpoint, an adapter rank above the pool's --max-lora-rank. What may
change by itself only makes the job wait: the pool not created yet, another job on the pool that
loads adapters under the same name (the versions would overwrite each other's), or the pool's unload
pod of a deleted or ended job with that name (a job deleted and created again under its name): it
unloads every `<name>-v<N>` it finds, so the new job's versions loaded while it still runs would go
too (docs/lora.md, "Cleanup"). Of two jobs with one adapter name the one created first runs and the
other waits (each waiting for the other would hold both forever).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lockstep.api.rljob import RLJobSpec
from lockstep.api.rolloutpool import PoolRole, RolloutPoolSpec


@dataclass(frozen=True, slots=True)
class PoolUser:
    """Another RLJob of the namespace, as the pool-reference check sees it."""

    name: str
    spec: RLJobSpec
    created: str
    """metadata.creationTimestamp (RFC 3339 in UTC: its string order is its time order)."""


@dataclass(frozen=True, slots=True)
class PoolRefProblem:
    """What keeps a job off its referenced pool; both None: nothing."""

    waiting: str | None = None
    """A reason to wait (Admitted=False), cleared by a change elsewhere."""
    reason: str = "PoolNotFound"
    """The condition's reason while waiting: PoolNotFound, AdapterNameInUse or AdapterUnloading."""
    invalid: str | None = None
    """A reason the job fails (the pool can never serve it as it is)."""


def adapter_name(spec: RLJobSpec, job: str) -> str:
    """A LoRA job's adapter name on the engines: model.lora.adapterName, else the job's name."""
    return (spec.model.lora.adapter_name if spec.model.lora else None) or job


def pool_ref_problem(
    spec: RLJobSpec,
    job: str,
    created: str,
    pool: RolloutPoolSpec | None,
    others: Sequence[PoolUser],
    *,
    namespace: str,
    unloading: Mapping[str, str] | None = None,
) -> PoolRefProblem:
    """The problem of job `job` (spec, creationTimestamp `created`) with the pool its rollout.poolRef
    names (`pool`: that pool's spec, None when it does not exist); `others`: the namespace's other
    RLJobs; `unloading`: adapter name -> the pool's unload pod of that name (any phase, terminating
    included: only its removal ends it), given for a job that has not started yet. A job without
    poolRef has none."""
    ref = spec.rollout.pool_ref
    if ref is None:
        return PoolRefProblem()
    if pool is None:
        return PoolRefProblem(
            waiting=f"rollout.poolRef: RolloutPool {ref.name} does not exist in namespace {namespace}: create it"
        )
    if pool.job is not None:
        return PoolRefProblem(
            invalid=f"rollout.poolRef: RolloutPool {ref.name} belongs to RLJob {pool.job}; reference a "
            "standalone pool (spec.job unset)"
        )
    if pool.role is PoolRole.TEACHER:
        return PoolRefProblem(
            invalid=f"rollout.poolRef: RolloutPool {ref.name} is a teacher pool (spec.role teacher), which no "
            "job updates: reference a standalone pool of role rollout"
        )
    if pool.model.checkpoint != spec.model.checkpoint:
        return PoolRefProblem(
            invalid=f"rollout.poolRef: RolloutPool {ref.name} serves {pool.model.checkpoint}, this job's "
            f"model.checkpoint is {spec.model.checkpoint}: adapters train on the base the pool serves"
        )
    job_rank = spec.model.lora.rank if spec.model.lora else 0
    pool_rank = pool.model.lora.rank if pool.model.lora else 0
    if job_rank > pool_rank:
        served = (
            f"--max-lora-rank {pool_rank} (its model.lora.rank)" if pool_rank else "no LoRA (no model.lora)"
        )
        return PoolRefProblem(
            invalid=f"model.lora.rank {job_rank} is above what RolloutPool {ref.name} serves: {served}; "
            "lower the rank, or use a pool with a larger model.lora.rank"
        )
    mine = adapter_name(spec, job)
    pod = (unloading or {}).get(mine)
    if pod is not None:
        return PoolRefProblem(
            reason="AdapterUnloading",
            waiting=f"model.lora.adapterName {mine}: pod {pod} still unloads the versions of an earlier job "
            f"with that name from RolloutPool {ref.name} (it would unload this job's too); this job starts "
            "once that pod is gone",
        )
    for other in sorted(others, key=lambda o: (o.created, o.name)):
        first = (other.created, other.name) < (created, job)
        if (
            other.name != job
            and first
            and other.spec.rollout.pool_ref == ref
            and adapter_name(other.spec, other.name) == mine
        ):
            return PoolRefProblem(
                reason="AdapterNameInUse",
                waiting=f"model.lora.adapterName {mine}: RLJob {other.name} loads adapters of that name on "
                f"RolloutPool {ref.name}; give this job another adapterName (waiting until {other.name} is gone)",
            )
    return PoolRefProblem()
