"""Mismatch correction (§4.2): TIS and clip-or-pop weights and the mismatch metrics."""

from __future__ import annotations

import math

import pytest
import torch
from lockstep.train.common.mismatch import MismatchConfig, mismatch_weights


def _lp(p: float) -> float:
    return math.log(p)


def test_seed_example_rollout_p_020_bounds_0_2() -> None:
    # Rollout sampled the token with p=0.20; the trainer (pre-update) gives 0.10, 0.30, 0.50.
    rollout = torch.tensor([[_lp(0.2), _lp(0.2), _lp(0.2)]])
    train = torch.tensor([[_lp(0.1), _lp(0.3), _lp(0.5)]])  # m = 0.5, 1.5, 2.5
    mask = torch.ones(1, 3)
    tis, metrics = mismatch_weights(train, rollout, mask, MismatchConfig("tis", 0.0, 2.0))
    assert tis[0].tolist() == pytest.approx([0.5, 1.5, 2.0], rel=1e-5)  # TIS damps 2.5 to 2.0
    pop, _ = mismatch_weights(train, rollout, mask, MismatchConfig("clip-or-pop", 0.0, 2.0))
    assert pop[0].tolist() == pytest.approx([0.5, 1.5, 0.0], rel=1e-5)  # clip-or-pop drops it
    off, _ = mismatch_weights(train, rollout, mask, MismatchConfig())
    assert off[0].tolist() == [1.0, 1.0, 1.0]
    # Metrics describe the unclipped ratio, whatever the mode.
    assert metrics["mismatch_ratio_mean"] == pytest.approx(1.5, rel=1e-5)
    assert metrics["mismatch_ratio_min"] == pytest.approx(0.5, rel=1e-5)
    assert metrics["mismatch_ratio_max"] == pytest.approx(2.5, rel=1e-5)
    assert metrics["mismatch_clipfrac"] == pytest.approx(1 / 3)
    assert metrics["mismatch_abs"] == pytest.approx((0.5 + 0.5 + 1.5) / 3, rel=1e-5)
    diffs = [abs(math.log(0.5)), abs(math.log(1.5)), abs(math.log(2.5))]
    assert metrics["train_rollout_logprob_abs_diff"] == pytest.approx(sum(diffs) / 3, rel=1e-5)
    k3 = [m - 1 - math.log(m) for m in (0.5, 1.5, 2.5)]
    assert metrics["train_rollout_kl"] == pytest.approx(sum(k3) / 3, rel=1e-5)
    assert metrics["mismatch_ess_ratio"] == pytest.approx(4.5**2 / (3 * (0.25 + 2.25 + 6.25)), rel=1e-5)


def test_masked_tokens_get_weight_zero_and_are_not_counted() -> None:
    rollout = torch.tensor([[-1.0, -5.0]])
    train = torch.tensor([[-1.0, 0.0]])  # second token would have m = e^5 but is masked out
    weights, metrics = mismatch_weights(train, rollout, torch.tensor([[1.0, 0.0]]), MismatchConfig("tis"))
    assert weights.tolist() == [[1.0, 0.0]]
    assert metrics["mismatch_tokens"] == 1.0
    assert metrics["mismatch_ratio_max"] == pytest.approx(1.0)
    assert metrics["mismatch_ess_ratio"] == pytest.approx(1.0)


def test_identical_logprobs_mean_no_mismatch() -> None:
    lp = torch.tensor([[-0.3, -2.0, -0.01]])
    _, metrics = mismatch_weights(lp, lp.clone(), torch.ones(1, 3), MismatchConfig("clip-or-pop"))
    assert metrics["train_rollout_logprob_abs_diff"] == 0.0
    assert metrics["mismatch_clipfrac"] == 0.0
    assert metrics["train_rollout_kl"] == pytest.approx(0.0, abs=1e-12)


def test_lower_bound_is_applied() -> None:
    rollout = torch.tensor([[_lp(0.5)]])
    train = torch.tensor([[_lp(0.1)]])  # m = 0.2
    tis, _ = mismatch_weights(train, rollout, torch.ones(1, 1), MismatchConfig("tis", 0.5, 2.0))
    pop, _ = mismatch_weights(train, rollout, torch.ones(1, 1), MismatchConfig("clip-or-pop", 0.5, 2.0))
    assert tis.item() == pytest.approx(0.5)
    assert pop.item() == 0.0


def test_bad_config_names_the_problem() -> None:
    with pytest.raises(ValueError, match="mode 'icepop' is unknown"):
        MismatchConfig("icepop")
    with pytest.raises(ValueError, match="0 <= low < high"):
        MismatchConfig("tis", 2.0, 1.0)
