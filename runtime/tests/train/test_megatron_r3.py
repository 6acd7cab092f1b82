"""R3 in the Megatron backend, the part that runs without CUDA: aligning the plan with the router's tokens.

megatron-core's router itself only runs on CUDA (its gating moves the weight there), so the replay is
tested end to end in test_megatron_gpu.py; here the overlay that builds the router's replay target:
sequence-first token order, the rollout's experts where the plan covers a token, the router's own
choices elsewhere (padding, the last token, rows without a payload), and the mismatch count.
"""

from __future__ import annotations

import pytest
import torch
from lockstep.train.common.r3 import R3PayloadError, build_replay, encode_routed_experts
from lockstep.train.megatron.r3 import RouterReplayHooks


def _plan() -> tuple[torch.Tensor, object]:
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    g = torch.Generator().manual_seed(0)
    payloads: list[bytes | None] = []
    for n in mask.sum(-1).tolist()[:2]:
        picks = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range((n - 1) * 3)])
        payloads.append(encode_routed_experts(picks.view(n - 1, 3, 2)))
    payloads.append(None)  # an aborted sample: routed freely
    return mask, build_replay(payloads, mask, num_layers=3, top_k=2, num_experts=8)


@pytest.mark.parametrize("replay", [True, False])
def test_overlay_puts_the_rollout_experts_in_sequence_first_order(replay: bool) -> None:
    _, plan = _plan()
    s, b = 5, 3
    own = torch.tensor([[0, 1]]).expand(s, b, 2).clone()  # the router's own top-k: experts 0 and 1 everywhere
    hooks = RouterReplayHooks(replay=replay, plan=plan)  # type: ignore[arg-type]
    target = hooks._overlay(own, layer=2, s=s, b=b)
    assert target.shape == (s * b, 2)
    by_row = target.view(s, b, 2).transpose(0, 1)  # back to [B, S, k]
    valid = plan.valid  # type: ignore[attr-defined]
    rollout = plan.indices[:, :, 2]  # type: ignore[attr-defined]
    if replay:
        assert torch.equal(by_row[:, :-1][valid], rollout[valid])
    else:
        assert (by_row == torch.tensor([0, 1])).all()
    assert (by_row[:, -1] == torch.tensor([0, 1])).all()  # the last token has no row: own choice
    assert (by_row[2] == torch.tensor([0, 1])).all() and (by_row[1, 2:] == torch.tensor([0, 1])).all()
    assert hooks.record.pairs == 4 + 2
    differs = (rollout[valid].sort(-1).values != torch.tensor([0, 1])).any(-1).sum().item()
    assert hooks.record.mismatched == differs > 0


def test_a_plan_of_another_shape_is_refused() -> None:
    _, plan = _plan()
    hooks = RouterReplayHooks(plan=plan)  # type: ignore[arg-type]
    with pytest.raises(R3PayloadError, match=r"router saw \[S=4, B=3\] tokens; the plan covers \[B=3, T=5\]"):
        hooks._overlay(torch.zeros(4, 3, 2, dtype=torch.long), layer=0, s=4, b=3)
