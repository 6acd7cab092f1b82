"""Golden tests of the shared bucketing pipeline (lockstep.weights.pipeline, §7.2.1)."""

from __future__ import annotations

import pytest
import torch
from lockstep.weights.pipeline import (
    PipelineConfig,
    atomic_units,
    fused_group_key,
    prepare_buckets,
    scale_group_key,
)


def t(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8)


def test_scale_and_fused_keys() -> None:
    assert scale_group_key("m.layers.0.mlp.down_proj.weight_scale_inv") == "m.layers.0.mlp.down_proj.weight"
    assert scale_group_key("m.layers.0.mlp.down_proj.input_scale") == "m.layers.0.mlp.down_proj.weight"
    # NVFP4's per-tensor scale travels with its weight too (it was a unit of its own: a bucket could split it off)
    assert scale_group_key("m.layers.0.mlp.down_proj.weight_scale_2") == "m.layers.0.mlp.down_proj.weight"
    assert scale_group_key("m.layers.0.mlp.down_proj.weight") == "m.layers.0.mlp.down_proj.weight"
    assert scale_group_key("m.norm.weight") == "m.norm.weight"
    assert fused_group_key("model.layers.3.self_attn.k_proj.weight") == "model.layers.3.self_attn.qkv_proj"
    assert (
        fused_group_key("model.layers.3.self_attn.q_proj.weight_scale_inv")
        == "model.layers.3.self_attn.qkv_proj"
    )
    assert fused_group_key("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.gate_up_proj"
    assert (
        fused_group_key("model.layers.3.self_attn.o_proj.weight") == "model.layers.3.self_attn.o_proj.weight"
    )


def test_buckets_are_size_bounded_and_keep_weight_with_scale() -> None:
    named = [
        ("a.weight", t(40)),
        ("b.weight", t(40)),
        ("b.weight_scale_inv", t(10)),  # 40 + 40 + 10 > 64: b and its scale move together
        ("c.weight", t(30)),
        ("big.weight", t(200)),  # larger than a bucket: travels alone
        ("d.weight", t(1)),
    ]
    buckets = list(prepare_buckets(named, PipelineConfig(bucket_bytes=64)))
    assert [b.names for b in buckets] == [
        ["a.weight"],
        ["b.weight", "b.weight_scale_inv"],
        ["c.weight"],
        ["big.weight"],
        ["d.weight"],
    ]
    assert [b.index for b in buckets] == [0, 1, 2, 3, 4]
    assert all(b.nbytes <= 64 for b in buckets if b.names != ["big.weight"])


def test_fused_group_stays_in_one_bucket() -> None:
    named = [(f"model.layers.0.self_attn.{p}_proj.weight", t(30)) for p in "qkv"]
    cfg = PipelineConfig(bucket_bytes=64, group_key=fused_group_key)
    assert [b.names for b in prepare_buckets(named, cfg)] == [[n for n, _ in named]]
    # Without the fused key the three parts split across buckets.
    assert len(list(prepare_buckets(named, PipelineConfig(bucket_bytes=64)))) == 2


def test_split_unit_is_an_error() -> None:
    named = [("b.weight", t(1)), ("c.weight", t(1)), ("b.weight_scale_inv", t(1))]
    with pytest.raises(ValueError, match="already emitted"):
        list(atomic_units(named, scale_group_key))


def test_experts_flush_on_pre_gather_bytes_times_ep() -> None:
    ep = 4
    experts = [(f"model.layers.0.mlp.experts.{i}.down_proj.weight", t(100)) for i in range(8)]
    named = [("model.embed_tokens.weight", t(10)), *experts]

    def expert_gather(chunk: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        # Stand-in for the EP all-gather: every rank contributes as many bytes as this one.
        return [(f"{n}@rank{r}", x) for r in range(ep) for n, x in chunk]

    cfg = PipelineConfig(bucket_bytes=800, expert_parallel=ep)
    buckets = list(prepare_buckets(named, cfg, expert_gather=expert_gather))
    assert buckets[0].names == ["model.embed_tokens.weight"] and not buckets[0].expert
    expert_buckets = buckets[1:]
    assert all(b.expert for b in expert_buckets)
    # pre-gather limit 800 / 4 = 200 bytes = 2 experts; post-gather 800 bytes = the nominal size.
    assert [b.nbytes for b in expert_buckets] == [800, 800, 800, 800]


def test_converter_and_gather_hooks_run_per_tensor() -> None:
    seen: list[str] = []

    def gather(name: str, x: torch.Tensor) -> torch.Tensor:
        seen.append(name)
        return torch.cat([x, x])

    def convert(name: str, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        q, k = x.chunk(2)
        return [(name.replace("qk", "q"), q), (name.replace("qk", "k"), k)]

    (bucket,) = prepare_buckets([("l.qk.weight", t(4))], gather=gather, convert=convert)
    assert seen == ["l.qk.weight"]
    assert [(n, x.numel()) for n, x in bucket.named_tensors] == [("l.q.weight", 4), ("l.k.weight", 4)]


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        PipelineConfig(bucket_bytes=0)
    with pytest.raises(ValueError, match="expert_parallel"):
        PipelineConfig(expert_parallel=0)
