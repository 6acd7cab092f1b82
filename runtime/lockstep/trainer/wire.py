"""The driver <-> trainer command wire: one pydantic model per request and reply (extra="forbid").

Why it exists: in a cluster the driver sends the trainer group's rank 0 one command per loop step
(lockstep.driver.remote -> lockstep.trainer.server); everything that crosses is validated at the
boundary, so a bad payload is a 400 naming the field instead of a wrong gradient. A group carries
every field the loss needs, token-exact; task metadata stays in the driver (the reward is computed).
Commands are POST /v2/<name> (COMMANDS), GET /v2/health answers HealthReply; every command carries
the group's instance ID (INSTANCE_HEADER), so a group that restarted since the driver attached
refuses it (409 `restarted`). It lives in the trainer layer, below the driver, so both sides import
it. docs/trainer.md has the command table and the failure semantics.

Who calls it: lockstep.driver.remote (client), lockstep.trainer.server (server), tests.
"""

from __future__ import annotations

import base64
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, model_validator

from lockstep.trainer.state import DriverState
from lockstep.types import Group, Sample, SampleStatus
from lockstep.weights.preflight import PreflightResult

API_PREFIX = "/v2"
"""Every command path starts with this (v2: the weight-update commands were renamed; a later
incompatible wire gets /v3)."""

COMMANDS = (
    "warm_start", "first_update", "train", "update_weights", "save", "load_latest", "shutdown", "sft_train",
)  # fmt: skip
"""The command names (POST /v2/<name>)."""


class _Strict(BaseModel):
    # NaN and inf cross as NaN / Infinity (pydantic's default writes null, which would turn a NaN
    # reward into "no reward" and hide the non-finite loss it must cause).
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class Empty(_Strict):
    """The body of a command without arguments."""


class SampleWire(_Strict):
    """One trajectory as the trainer needs it (lockstep.types.Sample without its task metadata)."""

    group_index: int
    """Group the sample belongs to."""
    index: int = Field(ge=0)
    """Index within its group."""
    prompt_ids: list[int] = Field(min_length=1)
    """Prompt token IDs as sent to the engine, length P."""
    response_ids: list[int]
    """Token IDs after the prompt, length R."""
    loss_mask: list[int]
    """Length R: 1 on policy-sampled tokens that train, 0 on environment tokens."""
    rollout_logprobs: list[float]
    """Length R: the engine's logprob of each sampled token."""
    token_versions: list[int | None]
    """Length R: the weight version that generated each token (None: environment token or unknown)."""
    reward: float | None = None
    """Scalar reward (already computed by the driver)."""
    status: SampleStatus = SampleStatus.COMPLETED
    """How the trajectory ended."""
    routed_experts_b64: str | None = None
    """R3 routing replay data (base64 of Sample.routed_experts), None for dense models."""
    label: str | None = None
    """Free label of the sample (e.g. the OPD route)."""
    teacher: str | None = None
    """OPD: the teacher that scored the sample."""
    teacher_logprobs: list[float] | None = None
    """OPD, length R: the teacher's logprob of each token (detached input of the advantage)."""
    opd_logratio: list[float] | None = None
    """OPD with a candidate set, length R: d_t per token, computed by the driver."""

    @model_validator(mode="after")
    def _lengths_agree(self) -> SampleWire:
        r = len(self.response_ids)
        for name in ("loss_mask", "rollout_logprobs", "token_versions", "teacher_logprobs", "opd_logratio"):
            if getattr(self, name) is None:
                continue
            n = len(getattr(self, name))
            if n != r:
                raise ValueError(f"{name} has {n} entries but response_ids has {r}; they must be equal")
        return self

    @model_validator(mode="after")
    def _values_train(self) -> SampleWire:
        """Every value the loss reads is one it can use: refused here, before any state changes (a
        reward of 1e308 used to overflow the advantages after the step was applied, a loss_mask of -1
        trained the token, a NaN logprob poisoned the importance ratio)."""
        problem = sample_values_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    @classmethod
    def of(cls, s: Sample) -> SampleWire:
        experts = base64.b64encode(s.routed_experts).decode() if s.routed_experts is not None else None
        return cls(
            group_index=s.group_index,
            index=s.index,
            prompt_ids=s.prompt_ids,
            response_ids=s.response_ids,
            loss_mask=s.loss_mask,
            rollout_logprobs=s.rollout_logprobs,
            token_versions=s.token_versions,
            reward=s.reward,
            status=s.status,
            routed_experts_b64=experts,
            label=s.label,
            teacher=s.teacher,
            teacher_logprobs=s.teacher_logprobs,
            opd_logratio=s.opd_logratio,
        )

    def sample(self) -> Sample:
        experts = base64.b64decode(self.routed_experts_b64) if self.routed_experts_b64 is not None else None
        return Sample(
            self.group_index,
            self.index,
            list(self.prompt_ids),
            list(self.response_ids),
            list(self.loss_mask),
            list(self.rollout_logprobs),
            list(self.token_versions),
            reward=self.reward,
            status=self.status,
            routed_experts=experts,
            label=self.label,
            teacher=self.teacher,
            teacher_logprobs=list(self.teacher_logprobs) if self.teacher_logprobs is not None else None,
            opd_logratio=list(self.opd_logratio) if self.opd_logratio is not None else None,
        )


REWARD_LIMIT = 1e9
"""Largest reward magnitude accepted: advantages are computed in float64 but the loss sums them over
up to millions of tokens in float32, where 1e9 x 1e6 stays finite; no reward function needs more."""


def sample_values_problem(s: SampleWire) -> str | None:
    """Why `s` cannot train (naming the field and the fix), or None. Token IDs are checked against
    the vocabulary by the server, which knows it (`ids_problem`)."""
    if s.reward is not None and not (math.isfinite(s.reward) and abs(s.reward) <= REWARD_LIMIT):
        return (
            f"reward {s.reward!r}: must be a finite number within +-{REWARD_LIMIT:g}; fix the reward function"
        )
    bad_mask = next((m for m in s.loss_mask if m not in (0, 1)), None)
    if bad_mask is not None:
        return f"loss_mask holds {bad_mask}: only 0 (not trained) and 1 (trained) are meaningful"
    for name in ("rollout_logprobs", "teacher_logprobs", "opd_logratio"):
        values = getattr(s, name) or []
        bad_lp = next((x for x in values if not math.isfinite(x)), None)
        if bad_lp is not None:
            return f"{name} holds {bad_lp!r}: it must be finite (the loss uses it as it is)"
    bad_v = next((v for v in s.token_versions if v is not None and not 0 <= v < 2**63), None)
    if bad_v is not None:
        return f"token_versions holds {bad_v}: weight versions are integers in [0, 2**63)"
    return None


def ids_problem(groups: list[GroupWire], vocab_size: int) -> tuple[str, str] | None:
    """(field path, message) of the first token ID outside [0, vocab_size), or None."""
    for gi, g in enumerate(groups):
        for si, s in enumerate(g.samples):
            for name in ("prompt_ids", "response_ids"):
                bad = next((t for t in getattr(s, name) if not 0 <= t < vocab_size), None)
                if bad is not None:
                    path = f"groups.{gi}.samples.{si}.{name}"
                    return path, f"{path}: token ID {bad} is outside the vocabulary [0, {vocab_size})"
    return None


class GroupWire(_Strict):
    """The samples of one prompt."""

    index: int
    """Unique group index within the run."""
    samples: list[SampleWire] = Field(min_length=1)
    """The group's samples in sample-index order."""

    @classmethod
    def of(cls, g: Group) -> GroupWire:
        return cls(index=g.index, samples=[SampleWire.of(s) for s in g.samples])

    def group(self) -> Group:
        return Group(self.index, [s.sample() for s in self.samples])


class SFTRowWire(_Strict):
    """One SFT training row: a whole conversation's token IDs and its loss mask (assistant tokens)."""

    input_ids: list[int] = Field(min_length=2)
    """The conversation rendered by the checkpoint's chat template."""
    loss_mask: list[int]
    """One entry per token: 1 on the assistant tokens that train, 0 elsewhere (the first token 0)."""

    @model_validator(mode="after")
    def _lengths_agree(self) -> SFTRowWire:
        if len(self.loss_mask) != len(self.input_ids):
            raise ValueError(
                f"loss_mask has {len(self.loss_mask)} entries but input_ids has {len(self.input_ids)}"
            )
        return self


class SFTTrainRequest(_Strict):
    """sft_train: one optimizer step of an SFT job on these rows."""

    rows: list[SFTRowWire] = Field(min_length=1)
    """The step's rows."""


class VersionRequest(_Strict):
    """first_update / update_weights: the version the engines must hold afterwards."""

    version: int = Field(ge=0, lt=2**63)
    """Weight version to update the engines to."""


class DriverStateWire(_Strict):
    """lockstep.trainer.state.DriverState on the wire (saved in the trainer's checkpoint)."""

    step: int = Field(ge=0)
    """RL optimizer steps done."""
    version: int = Field(ge=0)
    """The weight version the engines hold."""
    prompts_consumed: int = Field(ge=0)
    """Train-split prompts drawn so far."""
    next_group_index: int = Field(ge=0)
    """Index of the next group."""
    sft_done: bool
    """True once the SFT warm start ran."""
    pending_groups: list[list[int]] = Field(default_factory=list, max_length=1 << 20)
    """[group index, data position] of the groups drawn but not trained (fully-async)."""
    group_counts: dict[str, NonNegativeInt] = Field(default_factory=dict, max_length=64)
    """The buffer's counts of groups consumed and dropped so far (fully-async)."""

    @classmethod
    def of(cls, state: DriverState) -> DriverStateWire:
        return cls.model_validate(state.as_dict())

    def state(self) -> DriverState:
        return DriverState.from_dict(self.model_dump())


class TrainRequest(_Strict):
    """train: one RL optimizer step."""

    groups: list[GroupWire] = Field(min_length=1)
    """Complete groups (the batch)."""
    state: DriverStateWire | None = None
    """The driver's state once this step is done (its weight update included): what rank 0
    checkpoints with when SIGTERM comes before the driver's next save (preemption; None: not sent)."""


class SaveRequest(_Strict):
    """save: checkpoint the policy with the driver's state."""

    state: DriverStateWire
    """The loop's position, stored under "extra" of trainer_state.json."""


class MetricsReply(_Strict):
    """A step's metrics (float values, as metrics.jsonl holds them)."""

    metrics: dict[str, float]
    """Metric name -> value."""


class FirstUpdateReply(_Strict):
    """first_update: the update's metrics and, when the manifest asked for it, the pre-flight result."""

    metrics: dict[str, float]
    """Metric name -> value."""
    preflight: PreflightResult | None = None
    """spec.weightSync.checkWeightUpdateEqual's outcome (the driver reports it as the job's pre-flight)."""


class MetricsListReply(_Strict):
    """warm_start: per-step metrics."""

    steps: list[dict[str, float]]
    """One metrics dict per SFT step."""


class SaveReply(_Strict):
    """save: where the checkpoint went (on the trainer's file system)."""

    path: str
    """Checkpoint directory."""


class LoadReply(_Strict):
    """load_latest: the restored driver state, or null when the trainer has no checkpoint."""

    state: DriverStateWire | None
    """The DriverState saved with the latest checkpoint."""
    path: str | None = None
    """Where the restored checkpoint lives, on the trainer (None when there was none)."""


class OkReply(_Strict):
    """A command with nothing to report."""

    ok: Literal[True] = True
    """Always true."""


class HealthReply(_Strict):
    """GET /v2/health: whether rank 0 accepts commands."""

    ready: bool
    """All ranks have loaded the policy."""
    job: str
    """metadata.name of the job the trainer serves (the driver checks it is its own)."""
    world_size: int
    """Number of trainer ranks."""
    busy: str | None = None
    """The command running now, if any."""
    instance: str
    """Random ID of this start of the trainer group; the driver sends it back with every command
    (INSTANCE_HEADER), so commands meant for a group that has since restarted are refused."""


INSTANCE_HEADER = "X-Lockstep-Trainer-Instance"
"""Request header carrying HealthReply.instance; a mismatch is a 409 `restarted`."""


ErrorKind = Literal["bad_request", "unknown_command", "busy", "restarted", "draining", "non_finite_loss", "preflight_failed", "bad_settings", "engine_unreachable", "internal"]  # fmt: skip
"""What went wrong; the driver raises the matching exception (see lockstep.driver.remote)."""


class ErrorReply(_Strict):
    """Any failed command."""

    kind: ErrorKind
    """The error class."""
    message: str
    """One clear line; for bad_request it names the field."""
    field: str | None = None
    """The offending field path for bad_request (e.g. groups.0.samples.1.loss_mask)."""
    preflight: PreflightResult | None = None
    """For preflight_failed: the result naming the differing tensors."""
