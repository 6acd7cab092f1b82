"""TrainBatch: the tensors one optimizer step consumes, in the shifted [B, T-1] layout.

Why it exists: the loss, the backends and the driver must agree on one batch shape. Column t of every
[B, T-1] field refers to the token at position t+1 of `input_ids`, predicted by the logits at
position t (see packing.py). Slots are left for the capabilities that come next (reference logprobs
for KL, routing replay data for MoE R3, per-token teacher logprobs for OPD) so they slot in without
changing the backend protocol.

Who calls it: built by lockstep.train.common.packing; read by backends and losses.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class TrainBatch:
    """One batch of padded sequences. B rows (samples), T positions."""

    input_ids: torch.Tensor
    """[B, T] int64 token IDs: prompt then response, right-padded with the pad ID."""
    attention_mask: torch.Tensor
    """[B, T] int64, 1 on real tokens, 0 on padding."""
    loss_mask: torch.Tensor
    """[B, T-1] float32, 1 where the token at t+1 trains (policy-sampled response tokens only)."""
    rollout_logprobs: torch.Tensor
    """[B, T-1] float32, the engine's logprob of the token at t+1 (0 where loss_mask is 0)."""
    advantages: torch.Tensor
    """[B, T-1] float32, the sample's advantage broadcast over its trained tokens."""
    temperature: float = 1.0
    """Sampling temperature of the rollout; logits are divided by it before log-softmax so the
    trainer's logprob has the same definition as the engine's."""
    old_logprobs: torch.Tensor | None = None
    """[B, T-1] trainer logprobs with the pre-update weights (filled by the driver before train_step)."""
    ref_logprobs: torch.Tensor | None = None
    """[B, T-1] logprobs under the reference policy (the one RL started from), for the KL term; None when KL is off."""
    rewards: torch.Tensor | None = None
    """[B] float32 scalar reward per sample (for metrics)."""
    routed_experts: list[bytes | None] = field(default_factory=list)
    """Per-row R3 routing replay data (MoE); empty for dense models."""
    teacher_logprobs: torch.Tensor | None = None
    """[B, T-1] OPD: the teacher's logprob of the token at t+1 (0 where loss_mask is 0); None without OPD."""
    opd_logratio: torch.Tensor | None = None
    """[B, T-1] OPD with a candidate set: the set's estimate of d_t per token; None for sampled-token OPD."""
    teachers: list[str | None] = field(default_factory=list)
    """Per-row OPD teacher name (per-teacher metrics); empty without OPD."""

    @property
    def size(self) -> int:
        """Number of rows B."""
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Number of trained tokens (sum of loss_mask)."""
        return int(self.loss_mask.sum().item())

    def rows(self, start: int, stop: int) -> TrainBatch:
        """Rows [start, stop) as a new TrainBatch (a micro-batch); tensors are views, not copies."""

        def cut(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[start:stop]

        return replace(
            self,
            input_ids=self.input_ids[start:stop],
            attention_mask=self.attention_mask[start:stop],
            loss_mask=self.loss_mask[start:stop],
            rollout_logprobs=self.rollout_logprobs[start:stop],
            advantages=self.advantages[start:stop],
            old_logprobs=cut(self.old_logprobs),
            ref_logprobs=cut(self.ref_logprobs),
            rewards=cut(self.rewards),
            routed_experts=self.routed_experts[start:stop],
            teacher_logprobs=cut(self.teacher_logprobs),
            opd_logratio=cut(self.opd_logratio),
            teachers=self.teachers[start:stop],
        )

    def padded(self, rows: int) -> TrainBatch:
        """This batch with copies of row 0 appended up to `rows` rows that train nothing.

        The added rows have a zero loss mask, advantage and reward (and no R3 payload), so a backend
        can run equal-sized micro-batches (pipeline schedules, data-parallel shards) without changing
        the loss, the token count or any metric.
        """
        import torch

        missing = rows - self.size
        if missing <= 0:
            return self
        first = self.rows(0, 1)

        def cat(a: torch.Tensor | None, b: torch.Tensor | None, zero: bool = False) -> torch.Tensor | None:
            if a is None or b is None:
                return None
            return torch.cat([a, (torch.zeros_like(b) if zero else b).expand(missing, *b.shape[1:])])

        def cat_t(a: torch.Tensor, b: torch.Tensor, zero: bool = False) -> torch.Tensor:
            out = cat(a, b, zero)
            assert out is not None
            return out

        return replace(
            self,
            input_ids=cat_t(self.input_ids, first.input_ids),
            attention_mask=cat_t(self.attention_mask, first.attention_mask),
            loss_mask=cat_t(self.loss_mask, first.loss_mask, zero=True),
            rollout_logprobs=cat_t(self.rollout_logprobs, first.rollout_logprobs),
            advantages=cat_t(self.advantages, first.advantages, zero=True),
            old_logprobs=cat(self.old_logprobs, first.old_logprobs),
            ref_logprobs=cat(self.ref_logprobs, first.ref_logprobs),
            rewards=cat(self.rewards, first.rewards, zero=True),
            routed_experts=[*self.routed_experts, *[None] * missing] if self.routed_experts else [],
            teacher_logprobs=cat(self.teacher_logprobs, first.teacher_logprobs),
            opd_logratio=cat(self.opd_logratio, first.opd_logratio, zero=True),
            teachers=[*self.teachers, *[None] * missing] if self.teachers else [],
        )
