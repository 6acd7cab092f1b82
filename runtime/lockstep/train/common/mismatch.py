"""Train-rollout mismatch: measure it per sampled token and bound its effect on the gradient (§4.2).

Why it exists: even with identical tokens and weights, the engine and the trainer compute slightly
different logprobs (kernels, precision, batching), and in fully-async mode the rollout policy can be
an older version. For each sampled token t the mismatch ratio is

    m_t = exp(train_old_logp_t - rollout_logp_t)        (glossary: mismatch)

where train_old is the trainer's logprob with the pre-update weights and rollout is what the engine
reported. Two corrections multiply a weight w_t into the per-token policy loss:
- TIS:          w_t = clamp(m_t, low, high)   (outliers are damped, every token still trains)
- clip-or-pop:  w_t = m_t inside [low, high], 0 outside (outliers are removed from the gradient)
Bounds default to [0, 2]; since m_t > 0, a lower bound of 0 only ever touches the upper tail.
Example (rollout p=0.20): train p=0.30 gives m=1.5 and both keep 1.5; train p=0.50 gives m=2.5, TIS
keeps 2.0 and clip-or-pop drops the token (weight 0).

Metrics are always computed, correction on or off, because the distribution is what tells you
whether something upstream is broken (a wrong weight load shows up as a logprob abs diff jump).

Who calls it: lockstep.train.common.losses (inside the policy loss) and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MODES: tuple[str, ...] = ("off", "tis", "clip-or-pop")
"""Accepted correction modes."""


@dataclass(frozen=True, slots=True)
class MismatchConfig:
    """How to correct the train-rollout mismatch."""

    mode: str = "off"
    """off | tis | clip-or-pop."""
    low: float = 0.0
    """Lower bound l of the kept ratio interval."""
    high: float = 2.0
    """Upper bound u of the kept ratio interval."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"mismatch correction mode {self.mode!r} is unknown; use one of {', '.join(MODES)}"
            )
        if not 0.0 <= self.low < self.high:
            raise ValueError(f"mismatch bounds must satisfy 0 <= low < high, got [{self.low}, {self.high}]")


def mismatch_weights(
    train_old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    config: MismatchConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token correction weights and mismatch metrics.

    Inputs are [B, T] (or any equal shapes); `mask` is 1 on sampled tokens that train. Returns weights
    of the same shape (1 where mode is off, 0 where mask is 0), detached, and a metrics dict.
    """
    import torch

    mask_f = mask.to(torch.float32)
    log_m = (train_old_logprobs.detach().float() - rollout_logprobs.detach().float()) * mask_f
    m = torch.exp(log_m)  # [B, T]; exactly 1 on masked-out positions
    if config.mode == "tis":
        weights = m.clamp(min=config.low, max=config.high)
    elif config.mode == "clip-or-pop":
        inside = (m >= config.low) & (m <= config.high)
        weights = torch.where(inside, m, torch.zeros_like(m))
    else:
        weights = torch.ones_like(m)
    return weights * mask_f, mismatch_metrics(log_m, mask_f, config)


def mismatch_metrics(log_m: torch.Tensor, mask: torch.Tensor, config: MismatchConfig) -> dict[str, float]:
    """Statistics of the unclipped ratio m = exp(log_m) over tokens where mask is 1.

    - mismatch_ratio_{mean,min,max,p99}: the unclipped m_t distribution.
    - mismatch_clipfrac: share of tokens with m_t outside [low, high] (what TIS clamps / pop drops).
    - mismatch_abs: mean |m_t - 1|.
    - train_rollout_logprob_abs_diff: mean |train_old_logp - rollout_logp|.
    - train_rollout_kl: k3 estimate of KL(rollout || train), mean of m - 1 - log m (>= 0, unbiased
      on rollout samples).
    - mismatch_ess_ratio: effective sample size of the importance weights m over n,
      (sum m)^2 / (n * sum m^2), in (0, 1]; 1 means no mismatch.
    """
    import torch

    sel = mask > 0
    n = int(sel.sum().item())
    if n == 0:
        return {"mismatch_tokens": 0.0}
    lm = log_m[sel].double()
    m = torch.exp(lm)
    outside = (m < config.low) | (m > config.high)
    return {
        "mismatch_tokens": float(n),
        "mismatch_ratio_mean": m.mean().item(),
        "mismatch_ratio_min": m.min().item(),
        "mismatch_ratio_max": m.max().item(),
        "mismatch_ratio_p99": torch.quantile(m, 0.99).item(),
        "mismatch_clipfrac": outside.double().mean().item(),
        "mismatch_abs": (m - 1).abs().mean().item(),
        "train_rollout_logprob_abs_diff": lm.abs().mean().item(),
        "train_rollout_kl": (m - 1 - lm).mean().item(),
        "mismatch_ess_ratio": (m.sum() ** 2 / (n * (m * m).sum())).item(),
    }
