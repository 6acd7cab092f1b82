"""R3 payload decoding and alignment (pure), and the replay hook on a plain HF Qwen3-MoE model.

Golden bytes pin SGLang's wire format (base64 of little-endian int32 [tokens-1, layers, top-k], C
order); build_replay must put row i of a sample at column i of the shifted [B, T-1] layout; a payload
of the wrong length is an error naming the sample row and the expected shape. The hook must be a
no-op when the replayed experts are the model's own, and must force other experts when they differ.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import torch
from lockstep.models.tiny import tiny_moe_model
from lockstep.train.common.r3 import (
    R3PayloadError,
    build_replay,
    collate_routed_experts,
    decode_routed_experts,
    encode_routed_experts,
    hf_routing,
    payload_nbytes,
)
from lockstep.types import Group, Sample

# tokens 0..2 (n = 3), 2 layers, top-2: token 0 -> L0 {0,1} L1 {2,3}; token 1 -> L0 {4,5} L1 {6,7}.
GOLDEN_B64 = "AAAAAAEAAAACAAAAAwAAAAQAAAAFAAAABgAAAAcAAAA="
# n = 2, 2 layers, top-2: token 0 -> L0 [7, 2], L1 [1, 5] (order kept: the router's descending order).
GOLDEN_B64_SHORT = "BwAAAAIAAAABAAAABQAAAA=="


def test_golden_decode() -> None:
    got = decode_routed_experts(base64.b64decode(GOLDEN_B64), num_tokens=3, num_layers=2, top_k=2)
    assert got.dtype == torch.int64
    assert got.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert encode_routed_experts(got) == base64.b64decode(GOLDEN_B64)
    assert payload_nbytes(3, 2, 2) == 32
    # §4.1's example: 32K tokens, 60 layers, top-8 -> ~60 MiB per trajectory.
    assert round(payload_nbytes(32 * 1024, 60, 8) / 2**20) == 60


def test_build_replay_aligns_rows_with_shifted_columns() -> None:
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])  # n = 3, 2 (right-padded), 3
    plan = build_replay(
        [base64.b64decode(GOLDEN_B64), base64.b64decode(GOLDEN_B64_SHORT), None],
        mask,
        num_layers=2,
        top_k=2,
        num_experts=8,
    )
    assert plan is not None
    assert plan.indices.shape == (3, 2, 2, 2)  # [B, T-1, L, k]
    assert plan.valid.tolist() == [[True, True], [True, False], [False, False]]
    assert plan.indices[0].tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert plan.indices[1, 0].tolist() == [[7, 2], [1, 5]]
    assert plan.payload_bytes == 32 + 16
    assert build_replay([None, None], mask[:2], num_layers=2, top_k=2, num_experts=8) is None
    assert build_replay([], mask, num_layers=2, top_k=2, num_experts=8) is None


def test_wrong_length_names_the_sample_and_the_expected_shape() -> None:
    mask = torch.ones((2, 4), dtype=torch.long)  # n = 4 -> expected [3, 2, 2] = 48 bytes
    good = bytes(48)
    with pytest.raises(
        R3PayloadError, match=r"sample row 6: .*32 bytes.*expected int32 \[3, 2, 2\] = 48 bytes"
    ):
        build_replay([good, bytes(32)], mask, num_layers=2, top_k=2, num_experts=8, row_offset=5)
    with pytest.raises(R3PayloadError, match="2 entries for 3 rows"):
        build_replay([good, good], torch.ones((3, 4), dtype=torch.long), num_layers=2, top_k=2, num_experts=8)
    bad_id = encode_routed_experts(torch.full((3, 2, 2), 9))
    with pytest.raises(R3PayloadError, match="8 experts"):
        build_replay([good, bad_id], mask, num_layers=2, top_k=2, num_experts=8)
    with pytest.raises(R3PayloadError, match="no MoE layers"):
        build_replay([good, good], mask, num_layers=2, top_k=0, num_experts=0)


def test_collate_follows_pack_order() -> None:
    def smp(g: int, i: int, payload: bytes | None) -> Sample:
        return Sample(group_index=g, index=i, prompt_ids=[1], routed_experts=payload)

    groups = [
        Group(index=0, samples=[smp(0, 0, b"a"), smp(0, 1, None)]),
        Group(index=1, samples=[smp(1, 0, b"c")]),
    ]
    assert collate_routed_experts(groups) == [b"a", None, b"c"]


def _model() -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tiny_moe_model()
    model.eval()
    return model


def test_replaying_own_routing_is_a_no_op_and_foreign_routing_is_forced() -> None:
    model = _model()
    ids = torch.tensor([[2, 20, 21, 22, 3, 30], [2, 40, 41, 3, 50, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    with torch.no_grad(), hf_routing(model, None, capture=True) as own:
        base = model(input_ids=ids, attention_mask=mask).logits
    # The model's own routing as payloads (rows 0..n-2), then replayed: bit-identical logits.
    own_btlk = torch.stack([own.used[li].view(2, 6, 2) for li in (0, 1)], dim=2)  # [B, T, L, k]
    payloads = [encode_routed_experts(own_btlk[b, : int(mask[b].sum()) - 1]) for b in range(2)]
    plan = build_replay(payloads, mask, num_layers=2, top_k=2, num_experts=8)
    with torch.no_grad(), hf_routing(model, plan, replay=True) as rec:
        same = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(same, base)
    assert rec.pairs == (5 + 4) * 2 and rec.mismatched == 0
    # A foreign routing (every covered token to experts {6, 7}) is what the experts receive.
    assert plan is not None
    plan.indices[plan.valid] = torch.tensor([6, 7])
    with torch.no_grad(), hf_routing(model, plan, replay=True, capture=True) as forced:
        other = model(input_ids=ids, attention_mask=mask).logits
    for li in (0, 1):
        used = forced.used[li].view(2, 6, 2)[:, :-1]  # [B, T-1, k]
        assert (used[plan.valid] == torch.tensor([6, 7])).all()
    assert forced.mismatched > 0 and not torch.equal(other, base)


def test_routing_shape_from_config_json(tmp_path: Path) -> None:
    from lockstep.models.moe import routing_shape
    from lockstep.models.tiny import tiny_config, tiny_moe_config

    tiny_moe_config().save_pretrained(tmp_path / "moe")
    tiny_config().save_pretrained(tmp_path / "dense")
    shape = routing_shape(tmp_path / "moe")
    assert shape is not None and (shape.num_layers, shape.top_k, shape.num_experts) == (2, 2, 8)
    assert shape.payload_bytes(4096) == payload_nbytes(4096, 2, 2) == 4095 * 2 * 2 * 4
    assert routing_shape(tmp_path / "dense") is None
