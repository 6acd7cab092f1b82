"""P2P cuts each tensor exactly as SGLang's own weight loaders place it on every TP rank, for every family.

For each family we build (Qwen3 dense, Qwen3-MoE, GLM-4.7 = Glm4Moe, GLM-5 = GlmMoeDsa with MLA and
the DSA indexer), SGLang's model class from the pinned wheel is built on CPU at each rank of a
tensor-parallel group (and of an expert-parallel split for the MoE families), and its `load_weights`
takes the full HF checkpoint tensors. Every tensor carries its own disjoint range of integer values, so
after loading each element of each SGLang parameter says which HF tensor and which element it came
from: where a tensor landed (its place inside a fused qkv_proj, gate_up_proj or w13 included) is read
back, not assumed. The check: what the P2P sender writes for that tensor to that rank
(lockstep.weights.p2p.shard_for_target, cut to the slot shape the rank holds, over the rank's TP or
MoE-TP group) is exactly that region, element for element; the receiver's own default layout
(`target_shape`) is that region's shape; and a routed expert a rank does not hold has no slot.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_checkpoints import FAMILIES, model_config
from lockstep.numerics import experts
from lockstep.weights import p2p, reshard
from sglang_models import import_sglang, sglang_model, sglang_rank

LAYOUTS = [  # family, tp_size, ep_size
    ("qwen3", 2, 1),
    ("qwen3", 4, 1),  # 2 KV heads over 4 ranks: each head replicated on 2 ranks
    ("qwen3-moe", 2, 1),
    ("qwen3-moe", 4, 2),  # experts split over 2 EP groups of 2 MoE-TP ranks
    ("glm47", 2, 1),
    ("glm5", 2, 1),
    ("glm5", 4, 1),
]


def _config(family: str) -> Any:
    from transformers import Glm4MoeConfig

    if family == "glm47":
        return Glm4MoeConfig(
            vocab_size=200, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, attention_bias=True, tie_word_embeddings=False,
        )  # fmt: skip
    cfg = model_config(family, {s: i for i, s in enumerate(FAMILIES[family]["specials"])})
    cfg.vocab_size = 200  # not a multiple of 64: the padded vocabulary shows
    if family == "glm5":  # routing fields of GLM-5's published config.json that SGLang's DeepseekV2 reads
        for key, value in {"moe_layer_freq": 1, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
                           "scoring_func": "sigmoid", "routed_scaling_factor": 2.5}.items():  # fmt: skip
            if not hasattr(cfg, key):
                setattr(cfg, key, value)
    return cfg


def checkpoint(family: str, directory: Path) -> dict[str, torch.Tensor]:
    """The family's config in `directory` and its HF tensors (experts per expert, as the pipeline
    sends them), each a disjoint range of integers (float32 holds them exactly)."""
    from transformers import AutoModelForCausalLM

    cfg = _config(family)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    cfg.architectures = [type(model).__name__]
    cfg.torch_dtype = "float32"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_dict()))
    named: list[tuple[str, torch.Tensor]] = []
    for name, t in model.state_dict().items():
        x = experts.parse(name)
        named += (
            list(experts.split(name, t))
            if x is not None and x.expert is None and t.dim() == 3
            else [(name, t)]
        )
    out, base = {}, 1
    for name, t in named:
        out[name] = torch.arange(base, base + t.numel(), dtype=torch.float32).view(t.shape)
        base += t.numel()
    assert base < 2**24, "tags must stay exact in float32"
    return out


def region(params: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> torch.Tensor | None:
    """Where `tensor` (tagged) landed among SGLang's loaded parameters: the block of one parameter that
    holds its values, squeezed to the tensor's rank; None when this rank holds none of it."""
    if name in params and (reshard.is_vocab(name) or params[name].dtype != torch.float32):
        return params[name]  # the whole padded block (zeros past the vocabulary), or a bf16 copy
    lo, hi = tensor.min().item(), tensor.max().item()
    found = {n: (p >= lo) & (p <= hi) for n, p in params.items() if p.is_floating_point()}
    found = {n: m for n, m in found.items() if m.any()}
    if not found:
        return None
    suffix = ".".join(name.split(".")[-2:])  # e.g. kv_b_proj.weight: the parameter itself, not a derived copy
    pick = next((n for n in found if n.endswith(suffix)), max(found, key=lambda n: int(found[n].sum())))
    mask, param = found[pick], params[pick]
    idx = mask.nonzero()
    box = tuple(slice(int(idx[:, d].min()), int(idx[:, d].max()) + 1) for d in range(param.dim()))
    block = param[box]
    assert bool(((block >= lo) & (block <= hi)).all()), f"{name} is not one block of {pick}"
    while block.dim() > tensor.dim():
        block = block.squeeze(0)
    return block


@pytest.mark.parametrize(("family", "tp_size", "ep_size"), LAYOUTS)
def test_p2p_cuts_like_sglangs_loaders(family: str, tp_size: int, ep_size: int, tmp_path: Path) -> None:
    import_sglang()
    tagged = checkpoint(family, tmp_path)
    head_dim = getattr(_config(family), "head_dim", None)
    moe_tp = tp_size // ep_size
    checked = held_experts = 0
    for rank in range(tp_size):
        with sglang_rank(tmp_path, rank, tp_size, ep_size), torch.no_grad():
            model = sglang_model(tmp_path)
            for p in model.parameters():
                p.zero_()
            model.load_weights(list(tagged.items()))
            params = dict(model.named_parameters())
        info = p2p.P2PTargetInfo(session_id="-", buffer_ptr=0, buffer_bytes=0, tp_rank=rank, tp_size=tp_size,
                                 slots={}, moe_tp_rank=rank % moe_tp, moe_tp_size=moe_tp)  # fmt: skip
        for name, full in tagged.items():
            held = region(params, name, full)
            if held is None:  # only an expert-parallel rank may lack a tensor: another rank's experts
                assert ep_size > 1 and reshard.is_routed_expert(name), f"rank {rank} holds none of {name}"
                continue
            group_rank, group_size = p2p.group_of(info, name)
            ours = p2p.shard_for_target(name, full, group_rank, group_size, list(held.shape))
            # (a parameter SGLang keeps in bf16, the DSA indexer's weights_proj, holds the tags rounded)
            assert torch.equal(ours.to(held.dtype), held), (
                f"{family} tp={tp_size} ep={ep_size} rank {rank}: {name}"
            )
            default = p2p.target_shape(name, full.shape, group_size, head_dim=head_dim)
            assert default == list(held.shape), (name, default, list(held.shape))
            checked += 1
            held_experts += reshard.is_routed_expert(name)
    routed = sum(reshard.is_routed_expert(n) for n in tagged)
    assert checked >= len(tagged) * tp_size // max(ep_size, 1)
    if routed:  # every routed expert is held by exactly the ranks of its EP group
        assert held_experts == routed * moe_tp
