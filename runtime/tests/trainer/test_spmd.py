"""shard_rows: each rank's slice of a batch, padded so every rank runs the same micro-batches (pure)."""

from __future__ import annotations

import torch
from lockstep.train.common.batch import TrainBatch
from lockstep.trainer.spmd import shard_rows


def _batch(rows: int) -> TrainBatch:
    ids = torch.arange(rows * 4).reshape(rows, 4)  # [B, T]; row r holds 4r..4r+3
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=torch.ones(rows, 3),
        rollout_logprobs=-torch.ones(rows, 3),
        advantages=torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, 3) + 1,
        old_logprobs=-2 * torch.ones(rows, 3),
        rewards=torch.arange(rows, dtype=torch.float32),
    )


def test_even_split_is_a_plain_slice() -> None:
    b = _batch(4)
    parts = [shard_rows(b, r, 2) for r in range(2)]
    assert [p.input_ids[:, 0].tolist() for p in parts] == [[0, 4], [8, 12]]
    assert sum(p.num_tokens for p in parts) == b.num_tokens


def test_uneven_split_pads_with_rows_that_train_nothing() -> None:
    b = _batch(5)
    parts = [shard_rows(b, r, 2) for r in range(2)]
    assert [p.size for p in parts] == [3, 3]  # the same number of rows (micro-batches) on every rank
    assert parts[0].input_ids[:, 0].tolist() == [0, 4, 8]
    assert parts[1].input_ids[:, 0].tolist() == [12, 16, 0]  # row 0 repeated as padding
    pad = parts[1].rows(2, 3)
    assert pad.num_tokens == 0 and pad.advantages.abs().sum() == 0 and pad.rewards is not None
    assert pad.old_logprobs is not None and pad.old_logprobs.shape == (1, 3)
    assert sum(p.num_tokens for p in parts) == b.num_tokens  # every trained token exactly once


def test_more_ranks_than_rows() -> None:
    b = _batch(1)
    parts = [shard_rows(b, r, 3) for r in range(3)]
    assert [p.size for p in parts] == [1, 1, 1]
    assert [p.num_tokens for p in parts] == [3, 0, 0]
