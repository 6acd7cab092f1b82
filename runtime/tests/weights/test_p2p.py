"""P2P transport over Mooncake's TransferEngine on loopback TCP (lockstep.weights.p2p, §7.2.3)."""

from __future__ import annotations

import lockstep.weights.p2p as p2p
import pytest
import torch
from lockstep.weights.pipeline import PipelineConfig


def test_plan_one_to_one_then_round_robin() -> None:
    assert p2p.plan_transfers(2, 5) == [[0, 2, 4], [1, 3]]
    assert p2p.plan_transfers(4, 2) == [[0], [1], [], []]
    assert p2p.plan_transfers(3, 9) == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert p2p.plan_transfers(1, 3) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="sources"):
        p2p.plan_transfers(0, 1)


def test_target_layout_sharding() -> None:
    w = torch.arange(24.0).view(4, 6)
    q = p2p.shard_for_target("model.layers.0.self_attn.q_proj.weight", w, 1, 2)
    assert torch.equal(q, w[2:])
    o = p2p.shard_for_target("model.layers.0.self_attn.o_proj.weight", w, 0, 2)
    assert torch.equal(o, w[:, :3])
    n = p2p.shard_for_target("model.layers.0.input_layernorm.weight", w[0], 1, 2)
    assert torch.equal(n, w[0])
    # SGLang pads the vocabulary to a multiple of 64 before splitting it (runtime/tests/sglang checks it)
    assert p2p.target_shape("lm_head.weight", (10, 4), 2) == [32, 4]
    head = p2p.shard_for_target("lm_head.weight", w, 1, 2, [32, 6])
    assert head.shape == (32, 6) and not head.any()  # rank 1's block lies past the 4 real rows
    # fewer KV heads than ranks: each head replicated (2 heads of 2 rows over 4 ranks)
    assert p2p.target_shape("model.layers.0.self_attn.k_proj.weight", (4, 6), 4, head_dim=2) == [2, 6]
    k = p2p.shard_for_target("model.layers.0.self_attn.k_proj.weight", w, 1, 4, [2, 6])
    assert torch.equal(k, w[:2])
    with pytest.raises(ValueError, match="tp_size=4"):
        p2p.target_shape("model.layers.0.mlp.down_proj.weight", (4, 6), 4)


def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 8, generator=g).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g).bfloat16(),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(8, 8, generator=g).bfloat16(),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 32, generator=g),
        "model.norm.weight": torch.randn(8, generator=g),
    }


@pytest.mark.parametrize("verify", [True, False])
def test_loopback_update_into_tp_targets(verify: bool) -> None:
    sd = model()
    expected = {n: (t.dtype, tuple(t.shape)) for n, t in sd.items()}
    receivers = [p2p.P2PReceiver(expected, tp_rank=r, tp_size=2) for r in range(2)]
    receivers.append(p2p.P2PReceiver(expected))  # a TP=1 replica
    loaded: dict[int, dict[str, torch.Tensor]] = {}

    def committer(i: int) -> p2p.Commit:
        def commit(req: p2p.P2PCommitRequest) -> None:
            loaded[i] = {n: t.clone() for n, t in receivers[i].verified(req)}

        return commit

    targets = [p2p.P2PTarget(r.info(), committer(i)) for i, r in enumerate(receivers)]
    # A 512-byte staging buffer and 300-byte buckets force chunked writes (down_proj: 1 KiB) and several buckets.
    transport = p2p.P2PTransport(
        targets, staging_bytes=512, config=PipelineConfig(bucket_bytes=300), verify=verify
    )
    try:
        report = transport.update_weights(sd.items(), version=1)
    finally:
        transport.close()
    assert report.tensors == 3 * len(sd)
    for i, r in enumerate(receivers):
        tp_rank, tp_size = r.tp_rank, r.tp_size
        for name, full in sd.items():
            assert torch.equal(loaded[i][name], p2p.shard_for_target(name, full, tp_rank, tp_size)), (i, name)
    for r in receivers:
        r.close()


def test_failed_write_raises() -> None:
    sd = model()
    receiver = p2p.P2PReceiver({n: (t.dtype, tuple(t.shape)) for n, t in sd.items()})
    info = receiver.info()
    # Point the layout past the registered buffer: the peer rejects the write.
    bad = info.model_copy(update={"buffer_ptr": info.buffer_ptr + info.buffer_bytes})
    commits: list[int] = []
    good_target = p2p.P2PTarget(info, lambda req: commits.append(req.version))
    for targets in (
        [p2p.P2PTarget(bad, lambda req: commits.append(req.version))],  # last target: background write
        [p2p.P2PTarget(bad, lambda req: commits.append(req.version)), good_target],
    ):  # first: sync write
        transport = p2p.P2PTransport(targets, staging_bytes=1 << 16)
        try:
            with pytest.raises(p2p.P2PWriteError, match="failed"):
                transport.update_weights(sd.items(), version=1)
        finally:
            transport.close()
    assert commits == []  # nothing was activated
    receiver.close()


def test_commit_rejects_damaged_arrival() -> None:
    sd = model()
    receiver = p2p.P2PReceiver({n: (t.dtype, tuple(t.shape)) for n, t in sd.items()})
    with pytest.raises(p2p.P2PWriteError, match=r"model\.norm\.weight"):
        receiver.verified(
            p2p.P2PCommitRequest(
                version=1, names=["model.norm.weight"], checksums={"model.norm.weight": "0" * 32}
            )
        )
    receiver.close()
