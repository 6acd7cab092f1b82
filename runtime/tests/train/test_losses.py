"""Policy and SFT losses (lockstep.train.common.losses): golden values and gradient directions."""

from __future__ import annotations

import math

import pytest
import torch
from lockstep.train.common.batch import TrainBatch
from lockstep.train.common.losses import PolicyLossConfig, policy_loss, sft_loss
from lockstep.train.common.mismatch import MismatchConfig


def _batch(adv: list[float], old: list[float], rollout: list[float] | None = None) -> TrainBatch:
    n = len(adv)
    return TrainBatch(
        input_ids=torch.zeros(1, n + 1, dtype=torch.long),
        attention_mask=torch.ones(1, n + 1, dtype=torch.long),
        loss_mask=torch.ones(1, n),
        rollout_logprobs=torch.tensor([rollout if rollout is not None else old]),
        advantages=torch.tensor([adv]),
        old_logprobs=torch.tensor([old]),
    )


def test_ppo_clip_golden() -> None:
    # ratios exp(logp - old) = 1.5 (A=+1, clipped to 1.2), 0.5 (A=-1, clipped to 0.8), 1.0 (A=+2)
    old = [0.0, 0.0, 0.0]
    logp = torch.tensor([[math.log(1.5), math.log(0.5), 0.0]], requires_grad=True)
    loss, metrics = policy_loss(logp, _batch([1.0, -1.0, 2.0], old), PolicyLossConfig())
    # max(-A r, -A clip(r)): token 0 -> max(-1.5, -1.2) = -1.2; token 1 -> max(0.5, 0.8) = 0.8; token 2 -> -2
    assert loss[0].tolist() == pytest.approx([-1.2, 0.8, -2.0], rel=1e-5)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 3)
    loss.sum().backward()  # type: ignore[no-untyped-call]
    assert logp.grad is not None
    # Clipped tokens carry no gradient; the unclipped one pushes logp up for A > 0.
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == 0.0
    assert logp.grad[0, 2].item() == pytest.approx(-2.0)


def test_positive_advantage_raises_logprob() -> None:
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = policy_loss(logp, _batch([1.0, -1.0], [-1.0, -2.0]), PolicyLossConfig())
    loss.sum().backward()  # type: ignore[no-untyped-call]
    assert logp.grad is not None
    assert logp.grad[0, 0] < 0 < logp.grad[0, 1]  # descent raises token 0, lowers token 1


def test_tis_weight_multiplies_the_token_loss() -> None:
    old = [math.log(0.5)]
    rollout = [math.log(0.2)]  # m = 2.5, TIS clamps to 2
    logp = torch.tensor([old], requires_grad=True)
    cfg = PolicyLossConfig(mismatch=MismatchConfig("tis", 0.0, 2.0))
    loss, metrics = policy_loss(logp, _batch([1.0], old, rollout), cfg)
    assert loss.item() == pytest.approx(-2.0, rel=1e-5)
    assert metrics["mismatch_weight_mean"] == pytest.approx(2.0, rel=1e-5)
    pop = PolicyLossConfig(mismatch=MismatchConfig("clip-or-pop", 0.0, 2.0))
    loss, _ = policy_loss(logp, _batch([1.0], old, rollout), pop)
    assert loss.item() == 0.0


def test_gspo_uses_one_sequence_ratio() -> None:
    old = [0.0, 0.0]
    logp = torch.tensor([[0.2, -0.2]], requires_grad=True)  # mean log ratio 0 -> s = 1 for both tokens
    loss, metrics = policy_loss(logp, _batch([1.0, 1.0], old), PolicyLossConfig(estimator="gspo"))
    assert metrics["policy_ratio_mean"] == pytest.approx(1.0)
    assert loss[0].tolist() == pytest.approx([-1.0, -1.0])
    loss.sum().backward()  # type: ignore[no-untyped-call]
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-1.0, -1.0])


def test_kl_k3_is_added_and_needs_ref() -> None:
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    batch = _batch([0.0], [math.log(0.5)])
    cfg = PolicyLossConfig(kl_coef=0.1)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logp, batch, cfg)
    batch.ref_logprobs = torch.tensor([[math.log(0.25)]])
    loss, metrics = policy_loss(logp, batch, cfg)
    d = math.log(0.25) - math.log(0.5)
    k3 = math.exp(d) - d - 1
    assert metrics["kl_ref"] == pytest.approx(k3, rel=1e-5)
    assert loss.item() == pytest.approx(0.1 * k3, rel=1e-5)


@pytest.mark.parametrize(("estimator", "want"), [("k1", 0.5), ("k2", 0.125)])
def test_kl_k1_k2(estimator: str, want: float) -> None:
    logp = torch.tensor([[-1.0]], requires_grad=True)
    batch = _batch([0.0], [-1.0])
    batch.ref_logprobs = torch.tensor([[-1.5]])  # d = ref - logp = -0.5
    loss, metrics = policy_loss(logp, batch, PolicyLossConfig(kl_coef=1.0, kl_estimator=estimator))
    assert metrics["kl_ref"] == pytest.approx(want) and loss.item() == pytest.approx(want)


def test_sft_loss_is_masked_nll() -> None:
    batch = _batch([1.0, 1.0], [0.0, 0.0])
    batch.loss_mask = torch.tensor([[1.0, 0.0]])
    logp = torch.tensor([[-2.0, -7.0]])
    loss, metrics = sft_loss(logp, batch)
    assert loss.tolist() == [[2.0, 0.0]]
    assert metrics["sft_nll"] == pytest.approx(2.0)


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown estimator"):
        PolicyLossConfig(estimator="dpo")
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        PolicyLossConfig(kl_estimator="k4")
    with pytest.raises(ValueError, match="kl_coef"):
        PolicyLossConfig(kl_coef=-1.0)
