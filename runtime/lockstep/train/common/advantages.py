"""Advantage estimators: one scalar per sample, from the rewards of its group.

Why it exists: the loss needs an advantage per token; in critic-free RL (GRPO and relatives) every
token of a sample gets its sample's advantage, computed by comparing the sample's reward with the
other samples of the same prompt (its group). Pure functions, golden-tested.

What each estimator means here (said plainly, since names differ between papers and codebases):
- "grpo": A_i = (r_i - mean(r)) / (std(r) + eps) over the group (population std). A group whose
  rewards are all equal gets A = 0 for every sample (no signal, no update).
- "gspo": the same group-normalised advantage as GRPO; GSPO differs in the *ratio* (sequence-level,
  see losses.py), not in the advantage.
- "ppo": PPO's clipped objective with A_i = r_i - mean(r), a group-mean baseline and no std
  normalisation. There is NO learned value function (critic) and no GAE in Lockstep yet: this is
  "PPO-clip with a REINFORCE group baseline", not the actor-critic PPO of the original paper.

Who calls it: lockstep.train.common.packing (builds the per-token advantage tensor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

Estimator = Literal["grpo", "gspo", "ppo"]
"""Names accepted by `group_advantages` (and by the manifest's algorithm field)."""

ESTIMATORS: tuple[str, ...] = ("grpo", "gspo", "ppo")


def group_advantages(rewards: Sequence[float], estimator: str = "grpo", eps: float = 1e-6) -> list[float]:
    """Advantages of the samples of one group, in the same order as `rewards`.

    Raises ValueError naming the estimator when it is unknown, or when the group is empty.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; use one of {', '.join(ESTIMATORS)}")
    n = len(rewards)
    if n == 0:
        raise ValueError("a group needs at least one sample to compute advantages")
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if estimator == "ppo":
        return centred
    # Population std (divide by n): with n=2 and rewards (0, 1) this gives A = (-1, +1).
    std = math.sqrt(sum(c * c for c in centred) / n)
    return [c / (std + eps) for c in centred]


def batch_advantages(group_rewards: Sequence[Sequence[float]], estimator: str = "grpo") -> list[list[float]]:
    """`group_advantages` applied to every group of a batch (normalisation never crosses groups)."""
    return [group_advantages(rs, estimator) for rs in group_rewards]
