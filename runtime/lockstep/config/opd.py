"""On-policy distillation's configs from an RLJob (pure): routing and scoring, and where teachers are served.

Why it exists: lockstep.config is the one place the runtime reads the manifest; spec.algorithm.opd is read
here, into lockstep.rollout.opd.config's OPDConfig and TeacherSetup.

Who calls it: lockstep.config.driver (a run with spec.algorithm.opd).
"""

from __future__ import annotations

from lockstep.api import RLJob, TaskReward
from lockstep.rollout.opd.config import OPDConfig, TeacherSetup, TeacherSource


def opd_config(job: RLJob) -> OPDConfig | None:
    """How samples are routed and scored (spec.algorithm.opd); None without OPD."""
    opd = job.spec.algorithm.opd
    if opd is None:
        return None
    return OPDConfig(
        teachers=tuple(t.name for t in opd.teachers),
        routes={label: t.name for t in opd.teachers for label in t.labels},
        default_teacher=opd.default_teacher,
        label_key=opd.label_key,
        zero_task_reward=opd.task_reward is TaskReward.ZERO,
        candidate_set=opd.candidates.set.value,
        top_k=opd.candidates.top_k,
        weight=opd.candidates.weight.value,
    )


def teacher_setup(job: RLJob, *, seed: int, true_on_policy: bool, kv_cache_dtype: str) -> TeacherSetup:
    """Where each teacher is served; checkpoint teachers get the student's engine numerics (the run's
    seed, the engines' trueOnPolicy and kvCacheDtype, read where the run's configs map them)."""
    opd = job.spec.algorithm.opd
    teachers = opd.teachers if opd is not None else []
    return TeacherSetup(
        sources=tuple(
            TeacherSource(
                name=t.name,
                url=t.url,
                checkpoint=t.checkpoint,
                replicas=t.replicas,
                pool=t.pool_ref.name if t.pool_ref is not None else None,
            )
            for t in teachers
        ),
        seed=seed,
        true_on_policy=true_on_policy,
        kv_cache_dtype=kv_cache_dtype,
    )
