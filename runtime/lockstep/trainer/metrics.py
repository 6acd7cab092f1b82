"""The metrics of an RL step that come from its batch (pure): rewards, lengths, signal, entropy.

Why it exists: every step reports what it trained on next to what the backend measured; these are the
batch's side, computed the same way for a local trainer and a trainer group's rank 0.

Who calls it: lockstep.trainer.local (LocalTrainer.train).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from lockstep.rollout.group_signal import group_signal_metrics
from lockstep.types import Group, SampleStatus

if TYPE_CHECKING:
    from lockstep.train.common.batch import TrainBatch


def batch_metrics(groups: list[Group]) -> dict[str, float]:
    """Reward and length statistics of a batch (pure)."""
    samples = [s for g in groups for s in g.samples]
    rewards = [s.reward if s.reward is not None else 0.0 for s in samples]
    n = max(len(samples), 1)
    mean = sum(rewards) / n
    return {
        "reward_mean": mean,
        "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
        "response_len_mean": sum(len(s.response_ids) for s in samples) / n,
        "truncated_frac": sum(s.status is SampleStatus.TRUNCATED for s in samples) / n,
        "failed_samples": float(
            sum(s.status in (SampleStatus.FAILED, SampleStatus.ABORTED) for s in samples)
        ),
        **group_signal_metrics([g.rewards for g in groups]),
    }


def signal_metrics(batch: TrainBatch) -> dict[str, float]:
    """What the step could learn from: the mean |advantage| and the sampled tokens' entropy estimate.

    The entropy estimate is the mean negative logprob (pre-update, at the rollout temperature) of the
    trained tokens: an unbiased estimate of the policy's per-token entropy on its own samples.
    """
    mask = batch.loss_mask
    n = max(float(mask.sum().item()), 1.0)
    out = {"advantage_abs_mean": float((batch.advantages.abs() * mask).sum().item()) / n}
    if batch.old_logprobs is not None:
        out["entropy_estimate"] = float((-batch.old_logprobs * mask).sum().item()) / n
    return out
