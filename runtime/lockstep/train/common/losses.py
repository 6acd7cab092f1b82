"""RL and SFT losses on per-token logprobs in the shifted [B, T-1] layout.

Why it exists: the backends only know how to produce logprobs with gradients; what to do with them
(PPO-clip with token-level ratios, GSPO with a sequence-level ratio, optional KL to the reference
policy, mismatch correction, plain NLL for SFT) is decided here, once, for every backend.

Contract (`LossFn`): given `logprobs` [B, T-1] (with grad) and the micro-batch, return the per-token
loss [B, T-1] (already zero where loss_mask is 0) and metrics averaged over the micro-batch's trained
tokens. The backend sums the per-token loss over all micro-batches and ranks and divides by the
batch's total trained tokens: a token-mean loss, independent of how the batch is split.

Policy loss, per trained token t of sample i (A_i the sample's advantage, old = pre-update trainer
logprob, rollout = engine logprob):
    rho_t  = exp(logp_t - old_t)                          ("ppo"/"grpo": token-level ratio)
    rho_t  = exp(mean_t(logp - old)) of the sequence       ("gspo": sequence-level, grad per token)
    pg_t   = max(-A_i * rho_t, -A_i * clip(rho_t, 1 - eps_low, 1 + eps_high))
    loss_t = w_t * pg_t + kl_coef * kl_t                   (w_t from mismatch.py, 1 when off)
    kl_t   = k3: exp(ref_t - logp_t) - (ref_t - logp_t) - 1 (low-variance default; k1, k2 selectable)

Who calls it: lockstep.driver builds a loss with `make_policy_loss` / `sft_loss` and passes it to
`TrainBackend.train_step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from lockstep.train.common.advantages import ESTIMATORS
from lockstep.train.common.mismatch import MismatchConfig, mismatch_weights

if TYPE_CHECKING:
    import torch

    from lockstep.train.common.batch import TrainBatch


class LossFn(Protocol):
    """What `TrainBackend.train_step` calls on every micro-batch."""

    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Per-token loss [B, T-1] (zero off the loss mask) and micro-batch metrics."""
        ...


@dataclass(frozen=True, slots=True)
class PolicyLossConfig:
    """Knobs of the policy loss (the manifest's algorithm section maps onto this)."""

    estimator: str = "grpo"
    """grpo | gspo | ppo (see advantages.py for what each means here)."""
    eps_clip_low: float = 0.2
    """Lower PPO clip: the ratio is clipped at 1 - eps_clip_low (token-level estimators)."""
    eps_clip_high: float = 0.2
    """Upper PPO clip: 1 + eps_clip_high (0.28 gives DAPO's clip-higher)."""
    gspo_eps_low: float = 3e-4
    """GSPO's sequence-ratio clip range is much tighter than PPO's (the ratio is a geometric mean)."""
    gspo_eps_high: float = 4e-4
    """Upper GSPO clip."""
    kl_coef: float = 0.0
    """Weight of the KL term against the reference policy; 0 turns it (and ref logprobs) off."""
    kl_estimator: str = "k3"
    """Per-token KL(policy || ref) estimator on policy samples, with d = ref - logp: k1 = -d,
    k2 = d^2 / 2, k3 = exp(d) - d - 1 (unbiased and >= 0, the low-variance default)."""
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    """Train-rollout mismatch correction (off, tis, clip-or-pop) and its bounds."""

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"unknown estimator {self.estimator!r}; use one of {', '.join(ESTIMATORS)}")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"unknown KL estimator {self.kl_estimator!r}; use k1, k2 or k3")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    n = mask.sum()
    return float((x * mask).sum().item() / n.item()) if n.item() > 0 else 0.0


def _ratio(
    logprobs: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, sequence_level: bool
) -> torch.Tensor:
    import torch

    log_ratio = (logprobs - old) * mask  # [B, T-1]
    if not sequence_level:
        return torch.exp(log_ratio)
    # GSPO: s_i = exp(mean over the sample's tokens of log ratio); every token carries s_i's value but
    # its own gradient path (s_i.detach() * exp(logp - logp.detach()) has d/dlogp = s_i).
    seq = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    return torch.exp(seq.detach() + logprobs - logprobs.detach()) * mask + (1 - mask)


def policy_loss(
    logprobs: torch.Tensor, batch: TrainBatch, config: PolicyLossConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """The PPO-clip / GSPO policy loss with optional KL and mismatch correction (see module doc)."""
    import torch

    mask = batch.loss_mask
    old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
    gspo = config.estimator == "gspo"
    ratio = _ratio(logprobs, old, mask, gspo)
    lo, hi = (
        (config.gspo_eps_low, config.gspo_eps_high) if gspo else (config.eps_clip_low, config.eps_clip_high)
    )
    adv = batch.advantages
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - lo, 1.0 + hi)
    pg = torch.maximum(pg1, pg2)  # [B, T-1]
    weights, _ = mismatch_weights(old, batch.rollout_logprobs, mask, config.mismatch)
    loss = pg * weights
    metrics = {
        "pg_loss": _masked_mean(pg.detach(), mask),
        "pg_clipfrac": _masked_mean((pg2 > pg1).float(), mask),
        "policy_ratio_mean": _masked_mean(ratio.detach(), mask),
        "mismatch_weight_mean": _masked_mean(weights, mask),
    }
    if config.kl_coef > 0:
        if batch.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs in the batch (compute them with role='ref')")
        d = batch.ref_logprobs - logprobs  # [B, T-1]
        if config.kl_estimator == "k1":
            kl = -d
        elif config.kl_estimator == "k2":
            kl = 0.5 * d * d
        else:
            kl = torch.exp(d) - d - 1
        loss = loss + config.kl_coef * kl
        metrics["kl_ref"] = _masked_mean(kl.detach(), mask)
    return loss * mask, metrics


def make_policy_loss(config: PolicyLossConfig) -> LossFn:
    """A LossFn closing over `config` (what the driver passes to train_step)."""

    def fn(logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        return policy_loss(logprobs, batch, config)

    return fn


def sft_loss(logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the trained (assistant) tokens; a LossFn for the SFT warm start."""
    mask = batch.loss_mask
    nll = -logprobs * mask
    return nll, {"sft_nll": _masked_mean(nll.detach(), mask)}
