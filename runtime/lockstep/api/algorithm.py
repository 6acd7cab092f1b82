"""spec.algorithm: the RL objective and its corrections (advantages, KL, mismatch, OPD, SFT warm start,
learning-rate schedule, dynamic sampling).

Why it exists: the objective is the largest section of an RLJob and the only one that names teachers;
it and the names the operator and the driver derive from a teacher (its pool, its env vars) live here
together, with the Miles v0.1 defaults (docs/design.md).

Who uses it: lockstep.api.rljob (RLJobSpec.algorithm), lockstep.api.rules, lockstep.config (the loss,
the schedule, OPD's routing), the operator (teacher pools and the driver's env).
"""

from __future__ import annotations

import enum
from typing import Final

from pydantic import Field, model_validator

from lockstep.api.common import EMPTY_DEFAULT, NAME_PATTERN, ApiModel, Label, PoolRef


class AdvantageEstimator(enum.StrEnum):
    """How advantages are computed from rewards."""

    GRPO = "grpo"
    PPO = "ppo"
    GSPO = "gspo"


class MismatchCorrection(enum.StrEnum):
    """Per-token correction of the train-rollout mismatch m_t = exp(train_logp - rollout_logp)."""

    TIS = "tis"
    CLIP_OR_POP = "clip-or-pop"
    OFF = "off"


class KLEstimator(enum.StrEnum):
    """Estimator of KL(policy || reference) per token (Schulman's k1, k2, k3)."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


class MismatchSpec(ApiModel):
    """Train-rollout mismatch correction (§4.2)."""

    correction: MismatchCorrection = MismatchCorrection.OFF
    """`tis` multiplies each token's loss by clamp(m_t, low, high); `clip-or-pop` keeps m_t inside
    [low, high] and gives tokens outside weight 0; `off` applies nothing (metrics are still logged)."""
    low: float = Field(default=0.0, ge=0.0, le=1000.0)
    """Lower bound l of the ratio interval [l, u]; must be below high."""
    high: float = Field(default=2.0, gt=0.0, le=1000.0)
    """Upper bound u of the ratio interval [l, u]."""


class KLSpec(ApiModel):
    """KL penalty against the reference policy: the policy RL starts from (the warm-started one after an
    SFT warm start, else the checkpoint as loaded)."""

    coef: float = Field(default=0.0, ge=0.0, le=100.0)
    """Coefficient of the KL loss; 0 disables it (and the reference model is not loaded)."""
    estimator: KLEstimator = KLEstimator.K3
    """Per-token KL estimator."""


TEACHER_URLS_ENV: Final = "LOCKSTEP_TEACHER_URLS"
"""The driver pod's env var naming each teacher's router URL (a JSON object name -> base URL), written
by the operator for checkpoint and poolRef teachers."""


def teacher_api_key_env(teacher: str) -> str:
    """The driver pod's env var holding the API key of a poolRef teacher's standalone pool (that pool's
    own Secret; the job's key opens only the job's engines), e.g. `LOCKSTEP_TEACHER_API_KEY_MATH` (pure;
    teacher names are lowercase letters, digits and '-')."""
    return "LOCKSTEP_TEACHER_API_KEY_" + teacher.upper().replace("-", "_")


def teacher_pool_name(job: str, teacher: str) -> str:
    """The RolloutPool the operator runs for a checkpoint teacher of job `job` (pure)."""
    return f"{job}-teacher-{teacher}"


class Teacher(ApiModel):
    """One on-policy-distillation teacher: a served model that scores the student's tokens and is never
    updated. Exactly one of url, checkpoint and poolRef says where it is served."""

    name: str = Field(min_length=1, max_length=40, pattern=NAME_PATTERN)
    """Teacher name, unique in the list (its pool is `<job>-teacher-<name>`, its metrics
    `opd_<name>_*`)."""
    labels: list[Label] = Field(default_factory=list, max_length=16)
    """Sample labels routed to this teacher (the value of opd.labelKey in each prompt's data); a label
    names one teacher at most."""
    url: str | None = Field(default=None, min_length=1, max_length=512, pattern=r"^https?://")
    """Base URL of an SGLang server serving the teacher (`http://host:port`), run outside the job."""
    checkpoint: str | None = Field(default=None, min_length=1, max_length=1024)
    """The teacher's weights, in spec.model.checkpoint's forms: the operator runs a RolloutPool for it
    (`<job>-teacher-<name>`, role teacher: the rollout engine settings, never updated); `lockstep run`
    starts its engines in-process."""
    pool_ref: PoolRef | None = None
    """A standalone RolloutPool of role teacher (spec.job unset, spec.role teacher) already serving the
    teacher: the job reads it through its router Service with the pool's own API key and never updates
    it; several jobs may share it. In a cluster only (`lockstep run` needs a url or a checkpoint)."""
    replicas: int = Field(default=1, ge=1, le=4096)
    """Engine replicas of a checkpoint teacher's pool."""


class TaskReward(enum.StrEnum):
    """What OPD does with the task reward."""

    KEEP = "keep"
    ZERO = "zero"


class CandidateSet(enum.StrEnum):
    """Which tokens at each position the served-teacher estimate compares (§8.1)."""

    SAMPLED = "sampled"
    STUDENT_TOP_K = "student-top-k"
    TEACHER_TOP_K = "teacher-top-k"
    INTERSECTION = "intersection"
    UNION = "union"
    SYMMETRIC_DIFFERENCE = "symmetric-difference"


class CandidateWeight(enum.StrEnum):
    """How the tokens of a candidate set are weighted (normalized over the set)."""

    STUDENT = "student"
    TEACHER = "teacher"
    UNIFORM = "uniform"


class CandidatesSpec(ApiModel):
    """The per-position log-ratio of OPD: the sampled token alone, or a candidate set C_t."""

    set: CandidateSet = CandidateSet.SAMPLED
    """`sampled`: d_t = log p_old(y_t) - log q(y_t) of the sampled token (unbiased, one token). A set
    (`student-top-k`, `teacher-top-k`, their `intersection`, `union` or `symmetric-difference`):
    d_t = sum over C_t of w(v) (log p(v) - log q(v)), a selected-support approximation of the reverse KL
    (mass outside C_t is ignored) that costs a scoring pass of the student's engine and more bytes."""
    top_k: int = Field(default=8, ge=1, le=64)
    """K of the top-K sets."""
    weight: CandidateWeight = CandidateWeight.STUDENT
    """w(v): the `student` or `teacher` probability, or `uniform`, normalized over C_t."""


class OPDSpec(ApiModel):
    """On-policy distillation (§8.1): the student writes, served teachers score every token it wrote,
    and the log-ratio d_t = log p_old(y_t) - log q_teacher(y_t) enters the advantage as A_t - coef * d_t
    after the estimator. Teachers are routed by each sample's label, one teacher per sample."""

    teachers: list[Teacher] = Field(
        min_length=1,
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    """The teachers, keyed by name (names unique)."""
    default_teacher: str | None = Field(default=None, max_length=63)
    """Teacher for samples whose label no teacher lists; unset makes such a sample fail the run,
    naming the label."""
    coef: float = Field(default=1.0, ge=0.0, le=100.0)
    """beta of A_t - beta * d_t: the weight of the teacher's signal."""
    task_reward: TaskReward = TaskReward.KEEP
    """`keep` the task reward (OPD on top of RL) or `zero` it (pure distillation: the teacher's
    signal is all the student learns from; the task reward is still logged)."""
    label_key: str = Field(default="label", min_length=1, max_length=63)
    """The key of each prompt's data (a column of the data rows; built-in tasks set `label` to the
    task's name) whose value routes the sample."""
    candidates: CandidatesSpec = Field(default_factory=CandidatesSpec, json_schema_extra=EMPTY_DEFAULT)
    """The sampled token alone (default) or a candidate set per position."""

    @model_validator(mode="after")
    def _unique_teacher_names(self) -> OPDSpec:
        # the CRD declares teachers a map keyed by name; the apiserver refuses duplicates the same way
        names = [t.name for t in self.teachers]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"teacher names must be unique; repeated: {', '.join(repeated)}")
        return self

    def route(self, label: str | None) -> str | None:
        """The teacher a sample with `label` goes to, or None when no route and no default (pure)."""
        for teacher in self.teachers:
            if label is not None and label in teacher.labels:
                return teacher.name
        return self.default_teacher


class SFTWarmStartSpec(ApiModel):
    """Supervised steps on the task's reference answers before RL starts (off with steps 0)."""

    steps: int = Field(default=0, ge=0, le=100000000)
    """SFT optimizer steps before the first RL step (with stopAtLoss: the most it may take); 0 skips
    the warm start."""
    learning_rate: float | None = Field(default=None, gt=0.0, le=1.0)
    """Learning rate of the SFT steps; unset uses algorithm.learningRate."""
    stop_at_loss: float | None = Field(default=None, gt=0.0, le=100.0)
    """End the warm start once the mean SFT loss (per answer token) of its last 5 steps is at or
    below this. A fixed step count stops each seed at a different point of a steep loss curve (the
    tiny example's seeds were at 0.50 to 1.02 after 85 steps); a loss target stops every seed at the same point, so RL
    starts from comparable policies. Unset runs all `steps`."""


class LRDecay(enum.StrEnum):
    """How the RL learning rate moves from learningRate (after warmup) to minLearningRate."""

    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


class LRScheduleSpec(ApiModel):
    """The RL learning rate over the run's steps (spec.schedule.steps): a linear warmup from 0 to
    learningRate, then a decay to minLearningRate at the last step. The SFT warm start keeps its own
    constant rate. The default (no warmup, constant) is a constant learningRate."""

    warmup_steps: int = Field(default=0, ge=0, le=100000000)
    """RL steps of linear warmup (step k of n trains at learningRate x k / n); must be fewer than
    schedule.steps."""
    decay: LRDecay = LRDecay.CONSTANT
    """`constant`, `linear` or `cosine` from learningRate right after warmup towards minLearningRate,
    reached one step after the last (every step trains at a rate above it). A decay lets the policy
    settle late in the run, where a constant rate keeps perturbing a nearly solved policy."""
    min_learning_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    """Where a decay ends; at most learningRate."""


class DynamicSamplingSpec(ApiModel):
    """DAPO's dynamic sampling (sync schedule): a group whose samples all got the same reward has
    advantage 0 on every token and trains nothing, so it is dropped and more prompts are generated
    until the step holds batchSize groups with a reward spread. Costs rollouts, not optimizer steps;
    each step's groups_generated and groups_dropped are logged."""

    max_groups_per_step: int = Field(ge=1, le=1048576)
    """Most groups generated for one step, dropped ones included: at least algorithm.batchSize. When
    it is reached the step trains on the groups with a spread it has (on the first batchSize
    generated when none has one), so a step never waits forever on prompts the policy always or
    never solves."""


class AlgorithmSpec(ApiModel):
    """The RL objective and its corrections."""

    advantage_estimator: AdvantageEstimator = AdvantageEstimator.GRPO
    """`grpo` (group-normalised rewards), `ppo` or `gspo` (sequence-level ratios)."""
    samples_per_prompt: int = Field(default=8, ge=1, le=1024)
    """Samples per prompt: the size of a group."""
    batch_size: int = Field(default=8, ge=1, le=65536)
    """Groups (prompts) per optimizer step; a step trains on batchSize x samplesPerPrompt samples."""
    learning_rate: float = Field(default=1e-6, gt=0.0, le=1.0)
    """Optimizer learning rate."""
    eps_clip: float = Field(default=0.2, gt=0.0, le=10.0)
    """PPO ratio clip epsilon (lower, and upper unless epsClipHigh is set)."""
    eps_clip_high: float | None = Field(default=None, gt=0.0, le=10.0)
    """Upper PPO clip epsilon for asymmetric clipping; unset uses epsClip."""
    kl: KLSpec = Field(default_factory=KLSpec, json_schema_extra=EMPTY_DEFAULT)
    """KL penalty."""
    mismatch: MismatchSpec = Field(default_factory=MismatchSpec, json_schema_extra=EMPTY_DEFAULT)
    """Train-rollout mismatch correction, default off with bounds [0, 2]."""
    r3: bool = False
    """Rollout routing replay: the engine records the experts chosen per token per MoE layer and the
    trainer replays them (MoE models only)."""
    true_on_policy: bool = False
    """Deterministic, batch-invariant kernels on both sides so train and rollout logprobs are equal.
    Needs a registered model profile and the fsdp backend."""
    opd: OPDSpec | None = None
    """On-policy distillation: teachers score the student's tokens (docs/distillation.md); unset disables it."""
    sft_warm_start: SFTWarmStartSpec = Field(
        default_factory=SFTWarmStartSpec, json_schema_extra=EMPTY_DEFAULT
    )
    """SFT warm start on the task's reference answers before RL (off by default)."""
    lr_schedule: LRScheduleSpec = Field(default_factory=LRScheduleSpec, json_schema_extra=EMPTY_DEFAULT)
    """The RL learning rate over the steps: warmup and decay (default constant)."""
    dynamic_sampling: DynamicSamplingSpec | None = None
    """Drop groups without a reward spread and generate more (sync schedule); unset trains every
    group generated."""
