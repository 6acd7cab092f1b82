"""The Megatron backend on the CPU: config mapping, conversion tables, shards, bucket planning with EP.

megatron-core builds its models on the CPU (gloo, world size 1) but cannot run their forward there
(its rotary embedding needs CUDA), so these tests cover everything up to the forward: HF config ->
TransformerConfig, HF <-> Megatron tensors byte for byte (both expert spellings, every TP/EP/ETP/PP
split), loading into real megatron-core modules, the export's EP-aware buckets, and the refusals.
The forward, training, R3, offload and streaming run in test_megatron_gpu.py on the GPU machine.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from lockstep.models.tiny import bigger_config, materialize_builtin, tiny_config, tiny_moe_config
from lockstep.train.megatron.config import (
    ModelShape,
    ParallelLayout,
    UnsupportedModel,
    transformer_config_kwargs,
)
from lockstep.train.megatron.convert import (
    ExpertLayout,
    ShardSpec,
    canonical_model_to_hf,
    canonical_to_local,
    detect_expert_layout,
    fuse_qkv,
    hf_to_canonical,
    local_to_canonical_name,
    shard,
    split_qkv,
    stage_layers,
    unshard,
)
from lockstep.train.megatron.export import group_key
from lockstep.weights.pipeline import PipelineConfig, prepare_buckets


def _moe_shape(**overrides: Any) -> ModelShape:
    return ModelShape.from_hf(tiny_moe_config(**overrides))


def _hf_state(config: Any, seed: int = 0) -> dict[str, torch.Tensor]:
    """transformers' own state dict of a random-init model of `config` (fused experts in transformers 5)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The hub's spelling of the same experts: mlp.experts.<e>.{gate,up,down}_proj.weight."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"] = gate.clone()
                out[f"{base}{e}.up_proj.weight"] = up.clone()
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


# ------------------------------------------------------------------------------------ config mapping


def test_dense_qwen3_maps_onto_transformer_config() -> None:
    shape = ModelShape.from_hf(bigger_config(rope_theta=1_000_000.0))
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (
        28,
        1024,
        16,
        8,
        128,
    )
    assert shape.rope_theta == 1_000_000.0 and shape.tie_embeddings and not shape.is_moe
    kw = transformer_config_kwargs(shape, ParallelLayout(tensor=2, pipeline=4), bf16=True, cuda=True)
    assert kw["num_query_groups"] == 8 and kw["kv_channels"] == 128 and kw["ffn_hidden_size"] == 3072
    assert kw["qk_layernorm"] and kw["gated_linear_unit"] and kw["normalization"] == "RMSNorm"
    assert kw["params_dtype"] is torch.bfloat16 and kw["bf16"] and not kw["add_bias_linear"]
    assert (kw["tensor_model_parallel_size"], kw["pipeline_model_parallel_size"]) == (2, 4)
    assert kw["activation_func"] is torch.nn.functional.silu
    assert "num_moe_experts" not in kw


@pytest.mark.parametrize(("norm_topk", "pre_softmax"), [(True, False), (False, True)])
def test_moe_router_matches_hf_norm_topk_prob(norm_topk: bool, pre_softmax: bool) -> None:
    # HF: softmax over all experts, top-k, renormalise when norm_topk_prob. Megatron: pre_softmax False
    # takes top-k logits then softmax over them (= renormalised); True is softmax first, no renorm.
    shape = _moe_shape(norm_topk_prob=norm_topk, mlp_only_layers=[1], num_hidden_layers=3)
    kw = transformer_config_kwargs(shape, ParallelLayout(expert=2), bf16=True, cuda=True)
    assert kw["moe_router_pre_softmax"] is pre_softmax
    assert kw["moe_layer_freq"] == [1, 0, 1]  # layer 1 is dense (mlp_only_layers)
    assert (kw["num_moe_experts"], kw["moe_router_topk"], kw["moe_ffn_hidden_size"]) == (8, 2, 32)
    assert kw["moe_aux_loss_coeff"] == 0.0 and kw["moe_enable_routing_replay"]
    assert kw["moe_token_dispatcher_type"] == "alltoall"


def test_transformer_config_builds_on_cpu() -> None:
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        **transformer_config_kwargs(_moe_shape(), ParallelLayout(), bf16=False, cuda=False)
    )
    assert cfg.num_moe_experts == 8 and cfg.qk_layernorm and cfg.num_query_groups == 2


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope scaling 'yarn'"),
        ({"attention_bias": True}, "attention_bias is true"),
        ({"use_sliding_window": True, "sliding_window": 16}, "sliding-window"),
    ],
)
def test_unsupported_config_fields_are_refused_by_name(overrides: dict[str, Any], needle: str) -> None:
    with pytest.raises(UnsupportedModel, match=r"config\.json") as err:
        ModelShape.from_hf(tiny_config(**overrides))
    assert needle in str(err.value)


def test_unknown_architecture_is_refused() -> None:
    cfg = tiny_config()
    cfg.architectures = ["LlamaForCausalLM"]
    with pytest.raises(UnsupportedModel, match="LlamaForCausalLM is not built by the megatron backend"):
        ModelShape.from_hf(cfg)


@pytest.mark.parametrize(
    ("layout", "moe", "needle"),
    [
        (ParallelLayout(context=2), False, "context parallelism needs Transformer Engine"),
        (ParallelLayout(tensor=4), False, "does not divide the model's 2 key/value heads"),
        (ParallelLayout(pipeline=4), False, "does not divide the model's 2 layers"),
        (ParallelLayout(tensor=2), True, "tensor > 1 on a MoE model needs sequence parallelism"),
        (ParallelLayout(expert=3), True, "expert x expertTensor does not divide"),
        (ParallelLayout(expert=2), False, "on a dense model"),
    ],
)
def test_unrunnable_layouts_are_refused(layout: ParallelLayout, moe: bool, needle: str) -> None:
    shape = _moe_shape() if moe else ModelShape.from_hf(tiny_config())
    with pytest.raises(UnsupportedModel, match=r"^trainer\.parallelism: ") as err:
        layout.check(shape, world_size=8)
    assert needle in str(err.value)


def test_a_runnable_layout_passes() -> None:
    ParallelLayout(expert=4, expert_tensor=2).check(_moe_shape(), world_size=8)
    ParallelLayout(tensor=2, pipeline=2).check(ModelShape.from_hf(tiny_config()), world_size=8)


# ------------------------------------------------------------------------------------ conversion


def test_qkv_fusion_groups_query_heads_with_their_kv_head() -> None:
    shape = ModelShape.from_hf(tiny_config())  # 4 query heads, 2 KV heads, head_dim 16, hidden 64
    d, h = shape.head_dim, shape.hidden_size
    q = torch.arange(4 * d * h, dtype=torch.float32).reshape(4 * d, h)
    k, v = -torch.arange(2 * d * h, dtype=torch.float32).reshape(2 * d, h), torch.rand(2 * d, h)
    qkv = fuse_qkv(shape, q, k, v)
    # group 0: q heads 0, 1 then k head 0 then v head 0; group 1 likewise (megatron's GQA layout)
    expected = torch.cat([q[: 2 * d], k[:d], v[:d], q[2 * d :], k[d:], v[d:]])
    assert torch.equal(qkv, expected)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(shape, qkv), (q, k, v), strict=True))


def test_gated_fc1_shards_keep_gate_and_up_pairs() -> None:
    # Each TP rank applies SwiGLU to its own shard: the concatenated outputs must equal the full MLP's.
    gate, up = torch.randn(8, 4), torch.randn(8, 4)
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    full = torch.cat([gate, up])
    x = torch.randn(3, 4)
    ref = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
    parts = []
    for r in range(2):
        g, u = (x @ shard(name, full, r, 2).T).chunk(2, dim=-1)
        parts.append(torch.nn.functional.silu(g) * u)
    assert torch.allclose(torch.cat(parts, dim=-1), ref)
    assert torch.equal(unshard(name, [shard(name, full, r, 2) for r in range(2)]), full)


def _round_trip(
    shape: ModelShape, hf: dict[str, torch.Tensor], spec_sizes: dict[str, int]
) -> dict[str, torch.Tensor]:
    """HF -> every rank's local shards (all TP/EP/ETP/PP coordinates) -> canonical -> HF."""
    tp, pp, ep, etp = (spec_sizes.get(k, 1) for k in ("tp", "pp", "ep", "etp"))
    canonical: dict[str, list[tuple[ShardSpec, torch.Tensor]]] = {}
    for pr in range(pp):
        for tr in range(tp):
            for er in range(ep):
                for xr in range(etp):
                    spec = ShardSpec(tr, tp, pr, pp, er, ep, xr, etp)
                    layers = stage_layers(shape, pr, pp)
                    local = canonical_to_local(
                        shape, hf_to_canonical(shape, hf.__getitem__, set(hf), layers), spec
                    )
                    for name, t in local.items():
                        canonical.setdefault(local_to_canonical_name(name, spec, shape), []).append((spec, t))
    full = {}
    for name, shards in canonical.items():
        expert = ".local_experts." in name
        by_rank: dict[int, torch.Tensor] = {}
        for spec, t in shards:
            by_rank[spec.etp_rank if expert else spec.tp_rank] = t
        full[name] = unshard(name, [by_rank[r] for r in sorted(by_rank)])
    if shape.tie_embeddings:
        full.pop("output_layer.weight", None)  # PP > 1 keeps a copy on the last stage; HF has none
    return canonical_model_to_hf(shape, full, detect_expert_layout(set(hf)))


@pytest.mark.parametrize(
    "sizes", [{}, {"tp": 2}, {"pp": 2}, {"tp": 2, "pp": 2}], ids=["single", "tp2", "pp2", "tp2-pp2"]
)
def test_dense_round_trip_is_byte_identical(sizes: dict[str, int]) -> None:
    for tied in (True, False):
        config = tiny_config(tie_word_embeddings=tied)
        hf = _hf_state(config)
        back = _round_trip(ModelShape.from_hf(config), hf, sizes)
        assert set(back) == set(hf)
        assert all(torch.equal(back[k], hf[k]) for k in hf), [
            k for k in hf if not torch.equal(back[k], hf[k])
        ]


@pytest.mark.parametrize("spelling", ["fused", "per-expert"])
@pytest.mark.parametrize(
    "sizes",
    [{}, {"ep": 2}, {"ep": 4, "etp": 2}, {"ep": 2, "pp": 2}],
    ids=["single", "ep2", "ep4-etp2", "ep2-pp2"],
)
def test_moe_round_trip_is_byte_identical(spelling: str, sizes: dict[str, int]) -> None:
    config = tiny_moe_config(num_hidden_layers=4, mlp_only_layers=[2], tie_word_embeddings=False)
    hf = _hf_state(config)
    if spelling == "per-expert":
        hf = _per_expert(hf)
    assert detect_expert_layout(set(hf)) is ExpertLayout(spelling)
    back = _round_trip(ModelShape.from_hf(config), hf, sizes)
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_ep_ranks_hold_disjoint_contiguous_experts() -> None:
    config = tiny_moe_config()
    shape, hf = ModelShape.from_hf(config), _hf_state(config)
    held = []
    for er in range(4):
        spec = ShardSpec(ep_rank=er, ep_size=4)
        local = canonical_to_local(shape, hf_to_canonical(shape, hf.__getitem__, set(hf), range(2)), spec)
        names = sorted(
            n for n in local if ".local_experts." in n and n.startswith("decoder.layers.0.") and "fc1" in n
        )
        assert names == [
            f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc1.weight" for j in range(2)
        ]
        held += [local_to_canonical_name(n, spec, shape) for n in names]
        # local expert j of EP rank r is global expert 2r + j: compare the bytes
        assert torch.equal(local[names[1]], hf["model.layers.0.mlp.experts.gate_up_proj"][2 * er + 1])
    assert len(set(held)) == 8


@pytest.fixture(scope="module")
def megatron_world() -> Any:
    """megatron-core's parallel state over a one-rank gloo group (what building modules needs)."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    yield
    ps.destroy_model_parallel()
    if owns:
        dist.destroy_process_group()


@pytest.mark.parametrize("builtin", ["builtin:tiny", "builtin:tiny-moe"])
def test_checkpoint_loads_into_real_megatron_modules_and_back(
    megatron_world: Any, builtin: str, tmp_path: Path
) -> None:
    """The checkpoint file -> a megatron-core GPTModel (every parameter set, strictly) -> HF, byte-identical."""
    from lockstep.train.megatron.model import HFReader, build_gpt, load_into, local_weights

    path = materialize_builtin(builtin, tmp_path, seed=0)
    shape = ModelShape.from_checkpoint(path)
    model = build_gpt(shape, ParallelLayout(), ShardSpec(), bf16=False, cuda=False)
    load_into(model, local_weights(shape, path, ShardSpec()))
    canonical = {
        local_to_canonical_name(n, ShardSpec(), shape): p.detach() for n, p in model.named_parameters()
    }
    reader = HFReader(path)
    back = canonical_model_to_hf(shape, canonical, detect_expert_layout(reader.names))
    assert set(back) == reader.names
    assert all(torch.equal(back[k], reader.get(k)) for k in back)


def test_loading_refuses_missing_or_foreign_tensors(megatron_world: Any, tmp_path: Path) -> None:
    from lockstep.train.megatron.model import build_gpt, load_into, local_weights

    path = materialize_builtin("builtin:tiny", tmp_path, seed=0)
    shape = ModelShape.from_checkpoint(path)
    model = build_gpt(shape, ParallelLayout(), ShardSpec(), bf16=False, cuda=False)
    weights = local_weights(shape, path, ShardSpec())
    broken = copy.copy(weights)
    broken.pop("decoder.layers.1.self_attention.linear_qkv.weight")
    broken["decoder.layers.9.foo.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match=r"missing \['decoder.layers.1.self_attention.linear_qkv.weight'\]"):
        load_into(model, broken)
    wrong = dict(weights, **{"decoder.final_layernorm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"decoder\.final_layernorm\.weight: checkpoint shard has shape"):
        load_into(model, wrong)


# ------------------------------------------------------------------------------- export bucket planning


def test_expert_units_are_whole_layers_and_flush_at_pre_gather_bytes_times_ep() -> None:
    """The pipeline with the Megatron export's group_key: experts bucketed before an EP gather of 4."""
    ep, per, size = 4, 2, (32, 64)  # 2 local experts of [32, 64] fp32 = 8 KiB each
    nbytes = 32 * 64 * 4
    stream = []
    for layer in range(3):
        stream.append((f"model.layers.{layer}.self_attn.o_proj.weight", torch.zeros(64, 64)))
        for kind in ("linear_fc1", "linear_fc2"):
            for j in range(per):
                stream.append(
                    (f"decoder.layers.{layer}.mlp.experts.local_experts.{j}.{kind}.weight", torch.zeros(size))
                )

    def gather_ep(chunk: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        return [(f"{n}#r{r}", t) for n, t in chunk for r in range(ep)]  # what every EP rank contributes

    bucket = 2 * ep * per * nbytes  # room for two whole (layer, kind) units after the gather
    cfg = PipelineConfig(bucket_bytes=bucket, expert_parallel=ep, group_key=group_key)
    buckets = list(prepare_buckets(stream, cfg, expert_gather=gather_ep))
    experts = [b for b in buckets if b.expert]
    assert [len(b.named_tensors) for b in experts] == [2 * per * ep] * 3  # 6 units, two per bucket
    for b in experts:
        assert b.nbytes <= bucket  # post-gather buckets stay within the nominal size
        units = {group_key(n.split("#")[0]) for n in b.names}
        for unit in units:  # no (layer, kind) unit is split across buckets
            assert sum(1 for n in b.names if group_key(n.split("#")[0]) == unit) == per * ep


def test_group_key_keeps_scales_with_their_weight() -> None:
    assert (
        group_key("model.layers.0.self_attn.q_proj.weight_scale_inv")
        == "model.layers.0.self_attn.q_proj.weight"
    )
    assert group_key("decoder.layers.7.mlp.experts.local_experts.3.linear_fc2.weight") == (
        "decoder.layers.7.mlp.experts.linear_fc2"
    )
