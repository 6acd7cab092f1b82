"""OPD's advantage: A_t - beta * d_t after the estimator, with the seed's worked example (§8.1).

The student gives the sampled token probability 0.6, the teacher 0.2: d_t = log 0.6 - log 0.2 = 1.10,
so with beta 1 the token's advantage drops by 1.10; with the two swapped it rises by 1.10. The scores
are detached inputs: the policy loss's gradient does not reach them.
"""

from __future__ import annotations

import math

import pytest
import torch
from lockstep.train.common.opd import apply_opd
from lockstep.train.common.packing import pack_groups
from lockstep.types import Group, Sample


def _group(teacher_p: list[float], rewards: list[float]) -> Group:
    samples = []
    for i, (q, r) in enumerate(zip(teacher_p, rewards, strict=True)):
        samples.append(
            Sample(
                0, i, [1, 2], [3, 4], [1, 1], [math.log(0.6)] * 2, [0, 0], reward=r,
                teacher="t", teacher_logprobs=[math.log(q)] * 2,
            )
        )  # fmt: skip
    return Group(0, samples)


def test_the_seed_worked_example_gives_the_predicted_signs() -> None:
    batch = pack_groups([_group([0.2, 0.9], [1.0, 1.0])], "grpo")
    batch.old_logprobs = batch.rollout_logprobs.clone()  # the student's p = 0.6 on every token
    before = batch.advantages.clone()  # equal rewards: GRPO gives 0 everywhere
    metrics = apply_opd(batch, coef=1.0)
    delta = (batch.advantages - before)[batch.loss_mask > 0].view(2, 2)
    assert delta[0].tolist() == pytest.approx([-math.log(0.6 / 0.2)] * 2, abs=1e-6)  # -1.10: over-rated
    assert delta[0, 0].item() == pytest.approx(-1.0986, abs=1e-4)
    assert delta[1].tolist() == pytest.approx([-math.log(0.6 / 0.9)] * 2, abs=1e-6)  # +0.41: under-rated
    assert metrics["opd_tokens_scored"] == 4.0 and metrics["opd_t_tokens"] == 4.0


def test_swapped_probabilities_swap_the_sign() -> None:
    batch = pack_groups([_group([0.6], [0.0])], "grpo")
    batch.old_logprobs = torch.full_like(batch.rollout_logprobs, math.log(0.2)) * batch.loss_mask
    apply_opd(batch, coef=1.0)
    assert batch.advantages[batch.loss_mask > 0].tolist() == pytest.approx(
        [math.log(0.6 / 0.2)] * 2, abs=1e-6
    )


def test_the_signal_is_added_after_the_estimator_and_scaled_by_beta() -> None:
    batch = pack_groups([_group([0.6, 0.6], [1.0, 0.0])], "grpo")  # teacher = student: d_t = 0
    batch.old_logprobs = batch.rollout_logprobs.clone()
    grpo = batch.advantages.clone()
    apply_opd(batch, coef=3.0)
    assert torch.equal(batch.advantages, grpo)  # exactly: the estimator's advantages are kept
    batch.teacher_logprobs = batch.teacher_logprobs - 0.5 * batch.loss_mask  # the teacher is less sure
    apply_opd(batch, coef=3.0)
    assert torch.allclose(batch.advantages, grpo - 1.5 * batch.loss_mask)


def test_the_teacher_scores_are_detached_inputs() -> None:
    batch = pack_groups([_group([0.2], [0.0])], "grpo")
    old = batch.rollout_logprobs.clone().requires_grad_(True)
    batch.old_logprobs = old
    apply_opd(batch, coef=1.0)
    assert not batch.advantages.requires_grad


def test_a_candidate_set_estimate_replaces_the_sampled_log_ratio() -> None:
    group = _group([0.2], [0.0])
    group.samples[0].opd_logratio = [0.25, -0.5]
    batch = pack_groups([group], "grpo")
    batch.old_logprobs = batch.rollout_logprobs.clone()
    apply_opd(batch, coef=2.0)
    assert batch.advantages[batch.loss_mask > 0].tolist() == pytest.approx([-0.5, 1.0])


def test_a_trained_sample_without_teacher_scores_is_refused() -> None:
    group = _group([0.2, 0.2], [0.0, 1.0])
    group.samples[1].teacher_logprobs = None
    with pytest.raises(ValueError, match="0/1 trains but carries no teacher_logprobs"):
        pack_groups([group], "grpo")
