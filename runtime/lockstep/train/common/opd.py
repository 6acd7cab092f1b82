"""On-policy distillation in the trainer: the teacher's log-ratio folded into the advantage (§8.1).

Why it exists: OPD adds no loss of its own. After the estimator (GRPO, PPO-style, GSPO) has produced
the token advantages A_t, each trained token's advantage becomes A_t - beta * d_t, where
    d_t = log p_old(y_t) - log q_teacher(y_t)          (sampled-token OPD)
with p_old the trainer's logprob of the token under the pre-update weights (`old_logprobs`, the
seed's pi_old) and q_teacher the teacher's, scored on the same token IDs (`teacher_logprobs`). Or, for
a served-teacher candidate set, d_t is the set's estimate computed where both served models' scores
are (lockstep.rollout.opd.candidates) and arrives as `opd_logratio`. Both are detached inputs: the
gradient still flows through the policy loss only. Worked example of the seed: p = 0.6, q = 0.2 gives
d_t = log 0.6 - log 0.2 = 1.10, and with beta 1 the token's advantage drops by 1.10 (the student
over-rates it); swapped, it rises by 1.10.

Who calls it: lockstep.trainer.local (LocalTrainer.train, after the old logprobs are computed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lockstep.train.common.batch import TrainBatch


def sampled_logratio(old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """d_t = log p_old(y_t) - log q_teacher(y_t), elementwise over [B, T-1] (pure)."""
    return old_logprobs - teacher_logprobs


def apply_opd(batch: TrainBatch, coef: float) -> dict[str, float]:
    """Fold the teacher's signal into `batch.advantages` in place: A_t -= coef * d_t on trained tokens.

    d_t is `batch.opd_logratio` when a candidate set computed it, else the sampled-token log-ratio of
    `batch.old_logprobs` and `batch.teacher_logprobs`. Rows without a teacher (a skipped sample) have a
    zero loss mask and are left as they are. Returns the step's OPD metrics: the mean and mean absolute
    d_t over the scored tokens, the tokens scored, and per teacher the mean d_t (`opd_<name>_logratio_mean`)
    and its tokens.
    """
    import torch

    if batch.teacher_logprobs is None and batch.opd_logratio is None:
        raise ValueError("apply_opd: the batch carries no teacher scores (teacher_logprobs / opd_logratio)")
    if batch.opd_logratio is not None:
        d = batch.opd_logratio
    else:
        if batch.old_logprobs is None or batch.teacher_logprobs is None:
            raise ValueError("apply_opd: sampled-token OPD needs old_logprobs (compute them first)")
        d = sampled_logratio(batch.old_logprobs, batch.teacher_logprobs)
    scored = batch.loss_mask
    d = (d * scored).detach()  # [B, T-1]: a detached input, zero off the scored tokens
    batch.advantages = batch.advantages - coef * d
    n = float(scored.sum().item())
    metrics = {
        "opd_logratio_mean": float(d.sum().item()) / n if n else 0.0,
        "opd_logratio_abs_mean": float(d.abs().sum().item()) / n if n else 0.0,
        "opd_logratio_abs_max": float(d.abs().max().item()) if n else 0.0,
        "opd_tokens_scored": n,
        "opd_coef": coef,
    }
    for name in sorted({t for t in batch.teachers if t is not None}):
        rows = torch.tensor([t == name for t in batch.teachers], dtype=torch.bool)
        m = float(scored[rows].sum().item())
        metrics[f"opd_{name}_logratio_mean"] = float(d[rows].sum().item()) / m if m else 0.0
        metrics[f"opd_{name}_tokens"] = m
    return metrics
