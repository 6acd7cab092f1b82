"""Hand-off types shared by rollout, training, weight transfer and the driver.

Why it exists: every stage of the loop passes the same few things around (a sampled trajectory, a
group of trajectories of one prompt, a weight version). Defining them once, as slotted dataclasses,
keeps the stages swappable and makes the five per-token equalities of §2 checkable: each
sampled token carries its token ID, its rollout logprob and the weight version that produced it, and
the trainer reads exactly these. The words (version, step, sample, group, ...) are the glossary's
(docs/glossary.md). Nothing here imports torch.

Who uses it: lockstep.rollout (produces Samples), lockstep.trainer and lockstep.train (consume
Groups), lockstep.driver (moves them), lockstep.weights.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

WeightVersion = int
"""A published policy weight version. Engines report it as `weight_version` (a string in SGLang)."""


class SampleStatus(enum.StrEnum):
    """How a trajectory ended."""

    COMPLETED = "completed"
    """Stopped on an end-of-sequence or stop token."""
    TRUNCATED = "truncated"
    """Hit the token budget; still trainable."""
    ABORTED = "aborted"
    """Aborted by the engine or the driver; never trained on."""
    FAILED = "failed"
    """The agent, environment or reward raised; never trained on."""


@dataclass(slots=True)
class Sample:
    """One trajectory, token-exact as sampled (TITO): the trainer scores exactly these IDs.

    Lengths: `response_ids`, `loss_mask`, `rollout_logprobs` and `token_versions` all have length R
    (the number of tokens after the prompt, generated and environment tokens alike).
    """

    group_index: int
    """Index of the prompt group this sample belongs to (unique within a run)."""
    index: int
    """Index of the sample within its group, 0..samples_per_prompt-1."""
    prompt_ids: list[int]
    """Token IDs of the prompt as sent to the engine, length P."""
    response_ids: list[int] = field(default_factory=list)
    """Token IDs after the prompt, length R: sampled tokens and environment tokens (tool results)."""
    loss_mask: list[int] = field(default_factory=list)
    """Length R; 1 on tokens the policy sampled and that train, 0 on environment tokens."""
    rollout_logprobs: list[float] = field(default_factory=list)
    """Length R; the engine's logprob of each sampled token (0.0 where loss_mask is 0)."""
    token_versions: list[int | None] = field(default_factory=list)
    """Length R; the weight version that generated each token; None for environment tokens or unknown."""
    reward: float | None = None
    """Scalar reward from the reward function; None until scored."""
    status: SampleStatus = SampleStatus.COMPLETED
    """How the trajectory ended."""
    routed_experts: bytes | None = None
    """R3 routing replay data (int32, shape [P+R-1, layers, topk]) when enabled, else None."""
    label: str | None = None
    """Free label of the sample (e.g. the OPD teacher route)."""
    teacher: str | None = None
    """OPD: the teacher that scored this sample (its route), None without OPD."""
    teacher_logprobs: list[float] | None = None
    """OPD, length R: the teacher's logprob of each token, scored on these exact IDs (0.0 where
    loss_mask is 0); None until scored."""
    opd_logratio: list[float] | None = None
    """OPD with a candidate set, length R: the set's estimate of d_t per token (0.0 where loss_mask is
    0); None for sampled-token OPD (the trainer computes d_t from its own old logprobs)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Task data the reward function needs (e.g. the reference answer); never trained on."""

    def take_trajectory(self, traj: Mapping[str, Any]) -> None:
        """Set the token fields, the status and metadata["tito_mismatch"] from a session server's
        sample record (one entry of `POST /sessions/{id}/samples`, lockstep.rollout.session): the
        multi-turn agents' one way to turn a session into this sample."""
        self.prompt_ids = traj["prompt_ids"]
        self.response_ids = traj["response_ids"]
        self.loss_mask = traj["loss_mask"]
        self.rollout_logprobs = traj["rollout_logprobs"]
        self.token_versions = traj["token_versions"]
        self.status = SampleStatus(traj["status"])
        self.metadata["tito_mismatch"] = traj["mismatch"]

    def check(self) -> None:
        """Raise ValueError when the per-token lists disagree in length (a broken TITO invariant)."""
        r = len(self.response_ids)
        for name in ("loss_mask", "rollout_logprobs", "token_versions", "teacher_logprobs", "opd_logratio"):
            if getattr(self, name) is None:
                continue
            n = len(getattr(self, name))
            if n != r:
                raise ValueError(
                    f"sample {self.group_index}/{self.index}: {name} has {n} entries, response_ids {r}"
                )


@dataclass(slots=True)
class Group:
    """The samples of one prompt; the trainer consumes complete groups only."""

    index: int
    """Unique group index within a run."""
    samples: list[Sample]
    """samples_per_prompt samples, in sample-index order."""

    @property
    def rewards(self) -> list[float]:
        return [s.reward if s.reward is not None else 0.0 for s in self.samples]

    def token_versions(self) -> list[int | None]:
        """All per-token versions of the generated tokens of the group (for staleness, §5)."""
        out: list[int | None] = []
        for s in self.samples:
            out.extend(v for v, m in zip(s.token_versions, s.loss_mask, strict=True) if m)
        return out
