"""Which groups carry a learning signal: the group-signal metrics and dynamic sampling's keep rule.

Why it exists: with group-normalised advantages (GRPO and relatives) a group whose samples all got
the same reward has advantage 0 on every token: it costs a rollout and trains nothing. With an
exact-match reward that is every all-wrong group early in a run and every all-correct group late in
it, so the share of such groups says how much of a step's batch is signal (it differs from one data
seed to another: bench/seed_sweep.py reports it per seed). Dynamic sampling (DAPO) keeps generating groups until the step has enough groups with signal;
the rule for what counts lives here, as pure functions, so the loop, the metrics and the tests agree.

Who calls it: lockstep.driver.steps (dynamic sampling), lockstep.trainer.local (step metrics).
"""

from __future__ import annotations

from collections.abc import Sequence

from lockstep.types import Group

RewardRows = Sequence[Sequence[float]]
"""The rewards of each group of a batch."""


def has_signal(rewards: Sequence[float], tolerance: float = 1e-9) -> bool:
    """True when the group's rewards are not all equal (its advantages are not all zero)."""
    return bool(rewards) and max(rewards) - min(rewards) > tolerance


def group_signal_metrics(rewards: RewardRows) -> dict[str, float]:
    """Share of groups with zero reward variance, split into all-max and all-min reward (pure).

    `solved_groups_frac` counts groups whose samples all got reward >= 1 (exact match: all correct),
    `unsolved_groups_frac` those whose samples all got reward <= 0 (all wrong).
    """
    n = max(len(rewards), 1)
    return {
        "zero_variance_groups_frac": sum(not has_signal(rs) for rs in rewards) / n,
        "solved_groups_frac": sum(bool(rs) and min(rs) >= 1.0 for rs in rewards) / n,
        "unsolved_groups_frac": sum(bool(rs) and max(rs) <= 0.0 for rs in rewards) / n,
    }


def keep_groups(groups: Sequence[Group], tolerance: float = 1e-9) -> list[Group]:
    """Dynamic sampling's filter: the groups that carry a signal, in their order (pure)."""
    return [g for g in groups if has_signal(g.rewards, tolerance)]


def groups_to_generate(kept: int, generated: int, batch_groups: int, max_groups: int) -> int:
    """Dynamic sampling's next round: how many more groups to generate for this step (0 = stop). Pure.

    The missing ones (batch_groups - kept), within what the per-step cap still allows.
    """
    return max(0, min(batch_groups - kept, max_groups - generated))


def select_groups(generated: Sequence[Group], batch_groups: int) -> list[Group]:
    """What a step trains on under dynamic sampling: the first batch_groups groups with a reward
    spread; when none has one (the cap was reached), the first batch_groups generated. Pure."""
    kept = keep_groups(generated)
    return (kept or list(generated))[:batch_groups]
