"""The typed, keyword-only configs of on-policy distillation's rollout side.

Why it exists: the scorer and the teachers' engines must not read the RLJob; lockstep.config.opd builds
these once from spec.algorithm.opd. `OPDConfig` is how samples are routed and scored (`route` answers
which teacher a label goes to); `TeacherSetup` is where each teacher is served.

Who calls it: lockstep.config.opd (builds them), lockstep.rollout.opd.scorer and lockstep.driver.opd
(read them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lockstep.rollout.fatal import StopsTheRun


class UnroutedLabel(StopsTheRun, ValueError):
    """A sample's label routes to no teacher and there is no default teacher: the run fails, naming it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OPDConfig:
    """How samples are routed and scored."""

    teachers: tuple[str, ...]
    """Teacher names, in the manifest's order."""
    routes: Mapping[str, str]
    """Label -> teacher name (each label names one teacher)."""
    default_teacher: str | None
    """Teacher of samples whose label has no route; None: such a sample stops the run."""
    label_key: str
    """The key of Sample.metadata (the prompt's data) holding the label."""
    zero_task_reward: bool
    """Pure distillation: the sample's reward becomes 0 (the task reward is kept in metadata)."""
    candidate_set: str
    """`sampled` or a candidate set of lockstep.rollout.opd.candidates.SETS."""
    top_k: int
    """K of the top-K sets."""
    weight: str
    """Candidate weighting: student, teacher or uniform."""

    def route(self, label: object) -> str:
        """The teacher of a sample with `label` (the value under label_key, None when absent).

        Raises UnroutedLabel naming the label and the fix when no teacher lists it and there is no
        default teacher."""
        if isinstance(label, str) and label in self.routes:
            return self.routes[label]
        if self.default_teacher is not None:
            return self.default_teacher
        shown = f"label {label!r}" if label is not None else f"no label (its data has no {self.label_key!r})"
        raise UnroutedLabel(
            f"spec.algorithm.opd: a sample has {shown} under the data key {self.label_key!r}, which routes "
            f"to no teacher (routes: {dict(self.routes) or 'none'}) and there is no defaultTeacher: add "
            f"{label!r} to a teacher's labels or set defaultTeacher"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TeacherSource:
    """Where one teacher is served (exactly one of url, checkpoint, pool)."""

    name: str
    """The teacher's name."""
    url: str | None = None
    """An SGLang server run outside the job."""
    checkpoint: str | None = None
    """Weights the operator (in a cluster) or the driver (`lockstep run`) serves, never updated."""
    replicas: int = 1
    """Engines of a checkpoint teacher."""
    pool: str | None = None
    """A standalone RolloutPool (reached through the operator's LOCKSTEP_TEACHER_URLS)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TeacherSetup:
    """The teachers and how this process serves the checkpoint ones."""

    sources: tuple[TeacherSource, ...]
    """Every teacher, in the manifest's order."""
    seed: int = 0
    """spec.data.seed: a builtin checkpoint is built from it (as the student's is)."""
    true_on_policy: bool = False
    """Serve checkpoint teachers with the true on-policy kernels (as the student's engines)."""
    kv_cache_dtype: str = "auto"
    """The student's engines' KV-cache dtype (spec.rollout.kvCacheDtype), for the teachers' too."""
