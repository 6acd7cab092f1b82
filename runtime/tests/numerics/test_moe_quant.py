"""Expert weights quantized per expert at all four stages (§6), on builtin:tiny-moe and an HF Qwen3-MoE.

The two layouts meet here: the trainer and the reference engine hold one fused 3-D tensor per MoE
layer and projection (transformers >= 5), SGLang and HF checkpoints one 2-D weight per expert. Real
components: the conversion writes safetensors, the reference engine loads them and takes updates
in the export's layout, the FSDP2 trainer builds its fake-quantized forward.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lockstep.engine import ReferenceEngine
from lockstep.models.tiny import materialize_builtin
from lockstep.numerics import experts, quant
from lockstep.numerics.quant import Format, Scheme
from lockstep.numerics.recipe import Recipe, convert_checkpoint
from lockstep.train.fsdp import FSDPBackend, FSDPConfig
from safetensors.torch import load_file

# tiny-moe: I = 32, H = 64; fp8's default [128, 128] blocks do not fit I (see the fp8 test below)
SCHEMES = {
    Format.FP8: Scheme.of(Format.FP8, (32, 32)),
    Format.MXFP8: Scheme.of(Format.MXFP8),
    Format.NVFP4: Scheme.of(Format.NVFP4),
}
LAYER0 = "model.layers.0.mlp.experts"
LAYER1 = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = materialize_builtin("builtin:tiny-moe", tmp_path_factory.mktemp("moe"), seed=0)
    return path


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


def _scale_names(module: str, tensors: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in tensors if n.startswith(f"{module}.") and n.rsplit(".", 1)[1] in quant.SCALE_SUFFIXES]


@pytest.mark.parametrize("fmt", list(SCHEMES))
def test_routed_experts_are_quantized_per_expert_at_all_four_stages(
    moe_dir: Path, tmp_path: Path, fmt: Format
) -> None:
    recipe = Recipe(SCHEMES[fmt])
    base = load_file(str(moe_dir / "model.safetensors"))  # the trainer's names: fused 3-D experts
    assert base[f"{LAYER0}.gate_up_proj"].shape == (8, 64, 64)
    # 1. conversion: SGLang's per-expert names, each with its scales; no MoE layer ignored
    served_dir = convert_checkpoint(moe_dir, tmp_path / "served", recipe)
    converted = load_file(str(served_dir / "model.safetensors"))
    assert f"{LAYER0}.gate_up_proj" not in converted
    for e in range(8):
        for p in experts.PROJECTIONS:
            module = f"{LAYER0}.{e}.{p}"
            assert converted[f"{module}.weight"].dtype in (torch.float8_e4m3fn, torch.uint8)
            assert _scale_names(module, converted), module
    qc = json.loads((served_dir / "config.json").read_text())["quantization_config"]
    assert not [m for m in qc.get("ignored_layers", qc.get("exclude_modules")) if "experts" in m]
    # 3. export from the trainer's fused tensors: the same bytes as the conversion, name for name
    exported = dict(recipe.export(base.items()))
    assert set(exported) == set(converted)
    for name, t in exported.items():
        assert _same_bytes(t, converted[name]), name
    # 4. the engine holds exactly the served view (fused, under its own names) ...
    served = dict(recipe.served(base.items()))
    engine = ReferenceEngine.load(served_dir, context_length=64)
    live = engine.named_weights()
    assert torch.equal(live[f"{LAYER0}.gate_up_proj"], served[f"{LAYER0}.gate_up_proj"])
    assert not torch.equal(live[f"{LAYER0}.gate_up_proj"], base[f"{LAYER0}.gate_up_proj"])
    assert all(torch.equal(live[n], served[n]) for n in live), [
        n for n in live if not torch.equal(live[n], served[n])
    ]
    # ... and after an update in the export's layout (per-expert pairs into its fused parameters)
    moved = {n: t * 1.5 if t.is_floating_point() else t for n, t in base.items()}
    engine.load_weights(recipe.export(moved.items()))
    after, want = engine.named_weights(), dict(recipe.served(moved.items()))
    assert all(torch.equal(after[n], want[n]) for n in after)
    # 2. training forward: the experts compute with what the engine serves (per expert)
    backend = FSDPBackend(FSDPConfig(model_path=moe_dir, device="cpu", train_recipe=recipe))
    try:
        module = dict(backend.model.named_modules())[LAYER0]
        hooks = getattr(module, experts.HOOKS_ATTR)
        w13 = base[f"{LAYER0}.gate_up_proj"]
        for e in range(8):
            assert torch.equal(hooks.gate_up(w13[e]), served[f"{LAYER0}.gate_up_proj"][e])
        assert torch.equal(hooks.down(base[f"{LAYER0}.down_proj"][3]), served[f"{LAYER0}.down_proj"][3])
    finally:
        backend.close()


@pytest.mark.parametrize("fmt", list(SCHEMES))
def test_an_expert_exception_keeps_its_whole_moe_layer_bf16_at_all_four_stages(
    moe_dir: Path, tmp_path: Path, fmt: Format
) -> None:
    """`*.experts.*.down_proj` on layer 1: SGLang's FusedMoE is one precision, so all of layer 1's
    experts stay BF16 everywhere (one `...mlp.experts` entry), layer 0's are quantized."""
    recipe = Recipe(SCHEMES[fmt], ("model.layers.1.mlp.experts.*.down_proj",))
    base = load_file(str(moe_dir / "model.safetensors"))
    served_dir = convert_checkpoint(moe_dir, tmp_path / "served", recipe)  # 1
    converted = load_file(str(served_dir / "model.safetensors"))
    qc = json.loads((served_dir / "config.json").read_text())["quantization_config"]
    assert [m for m in qc.get("ignored_layers", qc.get("exclude_modules")) if "experts" in m] == [LAYER1]
    assert torch.equal(converted[f"{LAYER1}.gate_up_proj"], base[f"{LAYER1}.gate_up_proj"])
    assert not _scale_names(LAYER1, converted) and _scale_names(f"{LAYER0}.0.gate_proj", converted)
    exported = dict(recipe.export(base.items()))  # 3
    assert torch.equal(exported[f"{LAYER1}.down_proj"], base[f"{LAYER1}.down_proj"])
    assert not _scale_names(LAYER1, exported) and _scale_names(f"{LAYER0}.7.down_proj", exported)
    engine = ReferenceEngine.load(served_dir, context_length=64)  # 4
    engine.load_weights(exported.items())
    assert torch.equal(engine.named_weights()[f"{LAYER1}.gate_up_proj"], base[f"{LAYER1}.gate_up_proj"])
    backend = FSDPBackend(FSDPConfig(model_path=moe_dir, device="cpu", train_recipe=recipe))  # 2
    try:
        modules = dict(backend.model.named_modules())
        assert hasattr(modules[LAYER0], experts.HOOKS_ATTR)
        assert not hasattr(modules[LAYER1], experts.HOOKS_ATTR)
    finally:
        backend.close()


def test_a_pattern_naming_one_expert_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"spec.model.bf16Modules.*names one expert.*model.layers.N.mlp.experts"
    ):
        Recipe(SCHEMES[Format.FP8], ("model.layers.0.mlp.experts.3.down_proj",))


def test_fp8_experts_whose_size_sglang_cannot_block_stay_bf16(moe_dir: Path) -> None:
    """SGLang's Fp8MoEMethod refuses I % block_n != 0, and I % block_k != 0 under tensor parallelism
    (tiny-moe: I = 32 < 128): BF16, said why."""
    recipe = Recipe(Scheme.of(Format.FP8))
    d = recipe.decide(f"{LAYER0}.gate_up_proj", (8, 64, 64))
    assert not d.quantize and "intermediate size 32" in d.reason
    assert recipe.ignored([(f"{LAYER0}.2.down_proj.weight", (64, 32))]) == [LAYER0]
    down = (f"{LAYER0}.2.down_proj.weight", (64, 32))
    assert not Recipe(Scheme.of(Format.FP8, (32, 128))).quantizes(*down)  # the columns, with TP
    assert Recipe(Scheme.of(Format.FP8, (32, 32))).quantizes(*down)


@pytest.mark.parametrize("family", ["qwen3-moe", "glm5"])
def test_an_hf_per_expert_checkpoint_serves_the_trainers_served_view(
    tmp_path: Path, hf_checkpoint: Callable[[str], Path], family: str
) -> None:
    """A sharded HF Qwen3-MoE or GLM-5 (per-expert names on disk, gate and up of one expert possibly
    in two shards; GLM-5 with shared experts and MLA) in NVFP4: the engine holds exactly what the
    trainer's fused tensors quantize to, and each expert's gate and up carry one weight_scale_2
    (SGLang keeps the gate's for w13)."""
    src = hf_checkpoint(family)
    recipe = Recipe(SCHEMES[Format.NVFP4])
    served_dir = convert_checkpoint(src, tmp_path / "served", recipe)
    converted: dict[str, torch.Tensor] = {}
    for f in sorted(served_dir.glob("*.safetensors")):
        converted.update(load_file(str(f)))
    for e in range(8):
        g, u = (converted[f"{LAYER1}.{e}.{p}.weight_scale_2"] for p in ("gate_proj", "up_proj"))
        assert torch.equal(g, u)
    backend = FSDPBackend(FSDPConfig(model_path=src, device="cpu"))
    try:
        trainer = dict(backend.export_weights())  # transformers' fused names
    finally:
        backend.close()
    assert trainer[f"{LAYER1}.gate_up_proj"].dim() == 3
    served = dict(recipe.served(trainer.items()))
    live = ReferenceEngine.load(served_dir, context_length=64).named_weights()
    assert all(torch.equal(live[n], served[n]) for n in live), [
        n for n in live if not torch.equal(live[n], served[n])
    ]


@pytest.mark.parametrize("group", [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")])
def test_nvfp4_shards_of_one_fused_layer_share_weight_scale_2(tmp_path: Path, group: tuple[str, ...]) -> None:
    """SGLang's ModelOptFp4LinearMethod serves a fused layer (qkv_proj, gate_up_proj) under the max
    of its shards' weight_scale_2: the values it serves, dequantized SGLang's way, must be our
    served view, which holds only when the shards were quantized under one s2."""
    tiny = materialize_builtin("builtin:tiny", tmp_path / "tiny", seed=0)
    base = load_file(str(tiny / "model.safetensors"))
    recipe = Recipe(SCHEMES[Format.NVFP4])
    parent = "model.layers.0.self_attn" if "q_proj" in group else "model.layers.0.mlp"
    names = [f"{parent}.{p}.weight" for p in group]
    exported = dict(recipe.export((n, base[n]) for n in names))
    s2 = torch.stack([exported[n.replace(".weight", ".weight_scale_2")] for n in names])
    assert len(set(s2.tolist())) == 1
    served = dict(recipe.served((n, base[n]) for n in names))
    for n in names:  # SGLang: one weight_scale_2 per fused layer, the max of the shards'
        q, _ = quant.from_checkpoint(n, exported, recipe.scheme)
        assert q is not None
        as_sglang = quant.Quantized(q.scheme, q.values, q.scale, s2.max(), q.input_scale)
        assert torch.equal(quant.dequantize(as_sglang), served[n])
