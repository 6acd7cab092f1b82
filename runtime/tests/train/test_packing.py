"""Packing groups into the shifted [B, T-1] layout (lockstep.train.common.packing)."""

from __future__ import annotations

import pytest
from lockstep.train.common.packing import pack_groups, pack_sft, response_view
from lockstep.types import Group, Sample, SampleStatus


def _sample(
    i: int, prompt: list[int], resp: list[int], reward: float, mask: list[int] | None = None
) -> Sample:
    return Sample(
        group_index=0,
        index=i,
        prompt_ids=prompt,
        response_ids=resp,
        loss_mask=mask or [1] * len(resp),
        rollout_logprobs=[-0.1 * (k + 1) for k in range(len(resp))],
        token_versions=[0] * len(resp),
        reward=reward,
    )


def test_layout_golden() -> None:
    g = Group(0, [_sample(0, [5, 6, 7], [8, 9], 1.0), _sample(1, [5, 6], [10, 11, 12], 0.0, mask=[1, 0, 1])])
    b = pack_groups([g], "grpo", pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 10, 11, 12]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    # Row 0: prompt length 3 -> response token j at column 2 + j.
    assert b.loss_mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 1]]
    assert response_view(b, b.rollout_logprobs, 0) == pytest.approx([-0.1, -0.2])
    assert response_view(b, b.rollout_logprobs, 1) == pytest.approx([-0.1, -0.3])  # env token dropped
    assert response_view(b, b.advantages, 0) == pytest.approx([1.0, 1.0], abs=1e-5)
    assert response_view(b, b.advantages, 1) == pytest.approx([-1.0, -1.0], abs=1e-5)
    assert b.num_tokens == 4
    assert b.rewards is not None and b.rewards.tolist() == [1.0, 0.0]


def test_padding_is_masked_out() -> None:
    g = Group(0, [_sample(0, [5], [8], 1.0), _sample(1, [5, 6, 7], [8, 9, 10], 0.0)])
    b = pack_groups([g], pad_id=0)
    assert b.input_ids[0].tolist() == [5, 8, 0, 0, 0, 0]
    assert b.attention_mask[0].tolist() == [1, 1, 0, 0, 0, 0]
    assert b.loss_mask[0].tolist() == [1, 0, 0, 0, 0]


def test_failed_samples_never_train() -> None:
    bad = _sample(1, [5], [9, 9], 0.0)
    bad.status = SampleStatus.FAILED
    b = pack_groups([Group(0, [_sample(0, [5], [8], 1.0), bad])])
    assert b.loss_mask[1].sum().item() == 0


def test_broken_invariant_names_the_sample() -> None:
    s = _sample(0, [5], [8, 9], 1.0)
    s.rollout_logprobs = [-0.1]
    with pytest.raises(ValueError, match="sample 0/0: rollout_logprobs has 1 entries"):
        pack_groups([Group(0, [s])])


def test_sft_trains_assistant_tokens_only() -> None:
    b = pack_sft([([2, 20, 3], [30, 31, 1])])
    assert b.loss_mask.tolist() == [[0, 0, 1, 1, 1]]
    assert b.advantages.tolist() == [[0, 0, 1, 1, 1]]
    with pytest.raises(ValueError, match="empty batch"):
        pack_sft([])


def test_micro_batch_rows() -> None:
    b = pack_sft([([1], [2]), ([1], [3]), ([1], [4])])
    mb = b.rows(1, 3)
    assert mb.size == 2 and mb.input_ids[:, 1].tolist() == [3, 4]
