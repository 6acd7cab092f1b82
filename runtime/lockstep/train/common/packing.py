"""Packing: complete groups (or SFT pairs) -> one padded TrainBatch of tensors.

Why it exists: the trainer scores exactly the rollout's token IDs. This module lays each sample's
prompt and response IDs side by side in a right-padded [B, T] tensor and puts every per-token field
(loss mask, rollout logprob, advantage) in the *shifted* space [B, T-1]: column t holds the value for
the token at position t+1, which is predicted by the logits at position t. So the response token j
of a sample with prompt length P sits at column P-1+j. Padding is right-side and masked out.

Varlen packing (several samples per row, no padding) is a later optimisation that changes only this
module and the backend's forward; the [B, T-1] contract of the loss stays.

Who calls it: lockstep.driver (RL steps and the SFT warm start); backends slice it into micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from lockstep.train.common.advantages import group_advantages
from lockstep.train.common.batch import TrainBatch
from lockstep.types import Group, Sample, SampleStatus

if TYPE_CHECKING:
    import torch

_SKIPPED = (SampleStatus.ABORTED, SampleStatus.FAILED)


def pack_groups(
    groups: Sequence[Group], estimator: str = "grpo", pad_id: int = 0, temperature: float = 1.0
) -> TrainBatch:
    """Build the RL batch of `groups`; advantages are normalised within each group.

    Aborted and failed samples stay in their group's reward statistics as reward 0 but get loss mask 0
    (they never train). Raises ValueError (naming the sample) on a broken per-token invariant.
    """
    import torch

    rows: list[tuple[list[int], list[int], list[int], list[float], float]] = []
    rewards: list[float] = []
    samples = [s for g in groups for s in g.samples]
    for group in groups:
        advs = group_advantages(group.rewards, estimator)
        for sample, adv in zip(group.samples, advs, strict=True):
            sample.check()
            mask = [0] * len(sample.loss_mask) if sample.status in _SKIPPED else list(sample.loss_mask)
            rows.append((sample.prompt_ids, sample.response_ids, mask, sample.rollout_logprobs, adv))
            rewards.append(sample.reward if sample.reward is not None else 0.0)
    batch = _pad(rows, pad_id, temperature)
    batch.rewards = torch.tensor(rewards, dtype=torch.float32)
    if any(s.teacher_logprobs is not None for s in samples):  # OPD: the teachers' scores, same layout
        batch.teacher_logprobs = _per_token(batch, samples, "teacher_logprobs")
        batch.teachers = [s.teacher for s in samples]
        if any(s.opd_logratio is not None for s in samples):
            batch.opd_logratio = _per_token(batch, samples, "opd_logratio")
    return batch


def _per_token(batch: TrainBatch, samples: Sequence[Sample], name: str) -> torch.Tensor:
    """A per-response-token field of every sample in the shifted [B, T-1] layout (0 off the loss mask).

    A trained token without the value (a sample that was not scored) is a broken invariant: ValueError
    naming the sample."""
    import torch

    out = torch.zeros_like(batch.loss_mask)
    for i, s in enumerate(samples):
        values = getattr(s, name)
        p = len(s.prompt_ids)
        if values is None:
            if batch.loss_mask[i].any():
                raise ValueError(
                    f"sample {s.group_index}/{s.index} trains but carries no {name} (not scored)"
                )
            continue
        out[i, p - 1 : p - 1 + len(values)] = torch.tensor(values, dtype=torch.float32)
    return out * batch.loss_mask


def pack_sft(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int = 0, temperature: float = 1.0
) -> TrainBatch:
    """Build an SFT batch: each pair is (prompt IDs, assistant IDs); only assistant tokens train.

    The advantage is 1 on every trained token, so `sft_loss` is a plain token-mean NLL.
    """
    rows = [(list(p), list(r), [1] * len(r), [0.0] * len(r), 1.0) for p, r in pairs]
    return _pad(rows, pad_id, temperature)


def pack_masked(rows: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int = 0) -> TrainBatch:
    """Build an SFT batch of whole conversations: each row is (token IDs, loss mask per token); token t
    trains where its mask is 1 (predicted at shifted column t-1), so `sft_loss` is the token-mean NLL of
    exactly the masked tokens. ValueError when a row's mask has another length or trains its first token
    (nothing predicts it)."""
    import torch

    if not rows:
        raise ValueError("cannot pack an empty batch: no rows")
    t = max(len(ids) for ids, _ in rows)
    b = len(rows)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, t), dtype=torch.long)
    loss_mask = torch.zeros((b, t - 1), dtype=torch.float32)
    for i, (ids, mask) in enumerate(rows):
        if len(mask) != len(ids) or not ids:
            raise ValueError(f"row {i}: {len(mask)} mask entries for {len(ids)} tokens")
        if mask[0]:
            raise ValueError(f"row {i}: the first token cannot train (nothing before it predicts it)")
        n = len(ids)
        input_ids[i, :n] = torch.tensor(list(ids), dtype=torch.long)
        attention_mask[i, :n] = 1
        loss_mask[i, : n - 1] = torch.tensor(list(mask[1:]), dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        rollout_logprobs=torch.zeros_like(loss_mask),
        advantages=loss_mask.clone(),
    )


def _pad(
    rows: Sequence[tuple[list[int], list[int], list[int], list[float], float]],
    pad_id: int,
    temperature: float,
) -> TrainBatch:
    import torch

    if not rows:
        raise ValueError("cannot pack an empty batch: no samples were collected")
    for prompt, _resp, *_ in rows:
        if not prompt:
            raise ValueError("a sample has an empty prompt; the first response token needs a prompt token")
    t = max(len(p) + len(r) for p, r, *_ in rows)
    b = len(rows)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, t), dtype=torch.long)
    loss_mask = torch.zeros((b, t - 1), dtype=torch.float32)
    rollout = torch.zeros((b, t - 1), dtype=torch.float32)
    advantages = torch.zeros((b, t - 1), dtype=torch.float32)
    for i, (prompt, resp, mask, logps, adv) in enumerate(rows):
        p, r = len(prompt), len(resp)
        input_ids[i, : p + r] = torch.tensor(prompt + resp, dtype=torch.long)
        attention_mask[i, : p + r] = 1
        # Response token j is predicted at shifted column p-1+j.
        loss_mask[i, p - 1 : p - 1 + r] = torch.tensor(mask, dtype=torch.float32)
        rollout[i, p - 1 : p - 1 + r] = torch.tensor(logps, dtype=torch.float32)
        advantages[i, p - 1 : p - 1 + r] = adv
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        rollout_logprobs=rollout * loss_mask,
        advantages=advantages * loss_mask,
        temperature=temperature,
    )


def response_view(batch: TrainBatch, values: torch.Tensor, row: int) -> list[float]:
    """The per-token values of row `row`'s trained tokens, in order (for tests and debugging)."""
    sel = batch.loss_mask[row] > 0
    return [float(v) for v in values[row][sel]]
