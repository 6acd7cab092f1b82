"""SGLang as the oracle of the numerics contract: the switches and the checkpoint format Lockstep emits.

- `sglang_args_for(spec)` (true-on-policy switches, --quantization, --kv-cache-dtype) parses with
  SGLang's own ServerArgs parser and lands in the fields SGLang reads.
- The `quantization_config` our conversion writes is the one SGLang's fp8 loader reads: its
  `Fp8Config.from_config` (read from the installed source, not imported: fp8.py pulls CUDA kernels)
  takes `quant_method`, `activation_scheme`, `weight_block_size` and `ignored_layers`.
- Routed experts: every per-expert tensor we export maps, through SGLang's own
  make_expert_params_mapping, onto a parameter its fp8 / ModelOpt-FP4 MoE method registers, and
  SGLang skips (is_layer_skipped, ModelOpt's is_layer_excluded) exactly the MoE layers we keep BF16.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from lockstep.api import RLJobSpec
from lockstep.api.profiles import sglang_args_for
from lockstep.numerics.quant import Format, Scheme
from sglang_oracle import (
    expert_params_mapping,
    is_layer_skipped,
    modelopt_excludes,
    moe_parameter_shapes,
    parse_server_args,
    require_pinned_sglang,
    source,
)


@pytest.fixture(autouse=True)
def _sglang() -> None:
    require_pinned_sglang()


def _spec(**rollout: object) -> RLJobSpec:
    return RLJobSpec.model_validate(
        {
            "model": {"checkpoint": "Qwen/Qwen3-4B", "family": "qwen3", "variant": "4b"},
            "algorithm": {"trueOnPolicy": rollout.pop("true_on_policy", False)},
            "rollout": rollout,
            "trainer": {"backend": "fsdp"},
            "data": {"prompts": "builtin:reverse"},
        }
    )


def test_true_on_policy_switches_parse() -> None:
    args = parse_server_args(
        ["--model-path", "/models/qwen3-4b", *sglang_args_for(_spec(true_on_policy=True))]
    )
    flat = repr(vars(args)) if hasattr(args, "__dict__") else repr(args)
    assert "fsdp" in flat and "fa3" in flat


@pytest.mark.parametrize("precision", ["fp8", "mxfp8", "nvfp4"])
def test_quantization_and_kv_cache_parse(precision: str) -> None:
    spec = _spec(precision=precision, kvCacheDtype="fp8_e4m3")
    args = parse_server_args(["--model-path", "/models/qwen3-4b", *sglang_args_for(spec)])
    assert args.quantization == {"fp8": "fp8", "mxfp8": "mxfp8", "nvfp4": "modelopt_fp4"}[precision]
    assert args.kv_cache_dtype == "fp8_e4m3"


def _keys_read_by(cls: str, method: str) -> set[str]:
    """The config keys `cls.method` reads with get_from_keys / get_from_keys_or (string literals)."""
    tree = ast.parse(source("srt/layers/quantization/fp8.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == method:
                    for call in ast.walk(fn):
                        if isinstance(call, ast.List):
                            found |= {
                                e.value
                                for e in call.elts
                                if isinstance(e, ast.Constant) and isinstance(e.value, str)
                            }
    return found


@pytest.mark.parametrize("fmt", [Format.FP8, Format.MXFP8])
def test_our_quantization_config_is_what_sglangs_fp8_loader_reads(fmt: Format) -> None:
    keys = _keys_read_by("Fp8Config", "from_config")
    qc = Scheme.of(fmt).quantization_config(["model.layers.27.mlp.down_proj"])
    assert {"quant_method", "activation_scheme", "weight_block_size", "ignored_layers"} <= keys
    assert {"quant_method", "activation_scheme", "weight_block_size", "ignored_layers"} <= set(qc)
    assert qc["activation_scheme"] == "dynamic"  # SGLang asserts dynamic activations for block FP8
    assert ("mxfp8" in qc["quant_method"]) == (fmt is Format.MXFP8)  # how SGLang tells the two apart


def _registered_by(relative: str, cls: str) -> set[str]:
    """Parameter names the methods of `cls` register (`layer.register_parameter("name", ...)`; fp8.py
    registers them in a helper that create_weights calls)."""
    tree = ast.parse(source(relative).read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for call in ast.walk(node):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "register_parameter"
                    and call.args
                    and isinstance(call.args[0], ast.Constant)
                ):
                    names.add(str(call.args[0].value))
    return names


@pytest.mark.parametrize(
    ("fmt", "relative", "cls"),
    [
        (Format.FP8, "srt/layers/quantization/fp8.py", "Fp8LinearMethod"),
        (Format.MXFP8, "srt/layers/quantization/fp8.py", "Fp8LinearMethod"),
        (Format.NVFP4, "srt/layers/quantization/modelopt_quant.py", "ModelOptFp4LinearMethod"),
    ],
)
def test_every_tensor_we_export_is_a_parameter_sglangs_linear_layer_loads(
    fmt: Format, relative: str, cls: str
) -> None:
    """The names every transport carries (and convert-model writes) for one quantized linear layer
    are parameters SGLang's quantized linear method registers, so its load_weights takes them."""
    import torch
    from lockstep.numerics.quant import quantize, to_checkpoint

    q = quantize(torch.randn(256, 256), Scheme.of(fmt))
    suffixes = {
        name.removeprefix("model.layers.0.mlp.up_proj.")
        for name, _ in to_checkpoint("model.layers.0.mlp.up_proj.weight", q)
    }
    assert suffixes <= _registered_by(relative, cls), (suffixes, _registered_by(relative, cls))


@pytest.mark.parametrize("fmt", [Format.FP8, Format.MXFP8])
@pytest.mark.parametrize("pattern", ["model.layers.1.self_attn.q_proj", "*.up_proj", "model.layers.0.*"])
def test_sglang_loads_every_layer_of_our_checkpoint_in_one_precision(
    fmt: Format, pattern: str, tmp_path: Path
) -> None:
    """SGLang's own is_layer_skipped over the converted checkpoint's ignored_layers: each of its
    layers (fused q/k/v and gate/up, experts) is quantized or skipped whole, and skipped exactly where
    our recipe kept BF16 (an exception on one shard covers its fused group at every stage)."""
    import json

    from lockstep.models.tiny import materialize_builtin
    from lockstep.numerics.recipe import Recipe, convert_checkpoint
    from safetensors.torch import load_file

    recipe = Recipe(Scheme.of(fmt), (pattern,))
    served = convert_checkpoint(
        materialize_builtin("builtin:tiny", tmp_path / "src", seed=0), tmp_path / "s", recipe
    )
    ignored = json.loads((served / "config.json").read_text())["quantization_config"]["ignored_layers"]
    tensors = load_file(str(served / "model.safetensors"))
    for layer in range(2):
        for fused, parts in (("self_attn.qkv_proj", ("q", "k", "v")), ("mlp.gate_up_proj", ("gate", "up"))):
            prefix = f"model.layers.{layer}.{fused}"
            skipped = is_layer_skipped(prefix, ignored)  # raises where SGLang would refuse the checkpoint
            base = prefix.rsplit(".", 1)[0]
            for p in parts:
                quantized = f"{base}.{p}_proj.weight_scale_inv" in tensors
                assert quantized != skipped, (prefix, p, ignored)
        for single in ("self_attn.o_proj", "mlp.down_proj"):
            prefix = f"model.layers.{layer}.{single}"
            assert is_layer_skipped(prefix, ignored) != (f"{prefix}.weight_scale_inv" in tensors)


def test_without_the_fused_group_rule_sglang_would_refuse_the_checkpoint() -> None:
    """The oracle can fail: an ignored list naming q_proj alone is what SGLang refuses."""
    with pytest.raises(ValueError, match="not all shards"):
        is_layer_skipped("model.layers.1.self_attn.qkv_proj", ["model.layers.1.self_attn.q_proj"])


# -- routed experts ------------------------------------------------------------------------------

MOE_METHODS = {
    Format.FP8: ("srt/layers/quantization/fp8.py", "Fp8MoEMethod"),
    Format.MXFP8: ("srt/layers/quantization/fp8.py", "Fp8MoEMethod"),
    Format.NVFP4: ("srt/layers/quantization/modelopt_quant.py", "ModelOptNvFp4FusedMoEMethod"),
}
MOE_SCHEMES = {  # tiny-moe: I = 32, so fp8 with 32-row blocks (SGLang refuses I % block_n != 0)
    Format.FP8: Scheme.of(Format.FP8, (32, 32)),
    Format.MXFP8: Scheme.of(Format.MXFP8),
    Format.NVFP4: Scheme.of(Format.NVFP4),
}


def _sglang_expert_param(name: str, mapping: list[tuple[str, str, int, str]]) -> tuple[str, int, str] | None:
    """Qwen3-MoE's load_weights for an expert tensor: the first mapping whose checkpoint part is in
    the name renames it onto the FusedMoE parameter (param name, expert id, shard id); None: the
    name matches no expert and a fused layer would drop it."""
    for param, part, expert, shard in mapping:
        if part in name:
            return name.replace(part, param), expert, shard
    return None


def _tiny_moe(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    from lockstep.models.tiny import materialize_builtin
    from safetensors.torch import load_file

    src = materialize_builtin("builtin:tiny-moe", tmp_path / "moe", seed=0)
    return src, dict(load_file(str(src / "model.safetensors")))


@pytest.mark.parametrize("fmt", list(MOE_SCHEMES))
def test_every_expert_tensor_we_export_is_a_parameter_sglangs_moe_method_loads(
    fmt: Format, tmp_path: Path
) -> None:
    """The trainer's fused experts leave the export as per-expert tensors that SGLang's own
    expert_params_mapping renames onto w13_/w2_ parameters its MoE method registers, gate into
    shard w1, up into w3, down into w2, each expert into its own slot."""
    from lockstep.numerics.recipe import Recipe

    _, base = _tiny_moe(tmp_path)
    mapping = expert_params_mapping(8)
    registered = _registered_by(*MOE_METHODS[fmt])
    layer = "model.layers.0.mlp.experts"
    exported = [n for n, _ in Recipe(MOE_SCHEMES[fmt]).export(base.items()) if n.startswith(f"{layer}.")]  # type: ignore[arg-type]
    assert len(exported) == 8 * 3 * {Format.FP8: 2, Format.MXFP8: 2, Format.NVFP4: 4}[fmt]
    for name in exported:
        hit = _sglang_expert_param(name, mapping)
        assert hit is not None, f"SGLang's Qwen3-MoE loader drops {name}"
        param, expert, shard = hit
        assert param.startswith(f"{layer}.") and param.removeprefix(f"{layer}.") in registered, (
            name,
            param,
            registered,
        )
        e, proj = name.removeprefix(f"{layer}.").split(".")[:2]
        assert (expert, shard) == (int(e), {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj])


def test_a_fused_expert_name_is_one_sglangs_moe_loader_would_drop() -> None:
    """The oracle can fail: transformers' fused name (what the export sent before) maps onto no
    FusedMoE parameter, so SGLang's Qwen3-MoE load_weights would skip it without a word."""
    assert _sglang_expert_param("model.layers.0.mlp.experts.gate_up_proj", expert_params_mapping(8)) is None


@pytest.mark.parametrize("fmt", list(MOE_SCHEMES))
@pytest.mark.parametrize("pattern", ["model.layers.1.mlp.experts", "*.experts.*.up_proj", "model.layers.0.*"])
def test_sglang_skips_exactly_the_moe_layers_we_keep_bf16(fmt: Format, pattern: str, tmp_path: Path) -> None:
    import json

    from lockstep.numerics.recipe import Recipe, convert_checkpoint
    from safetensors.torch import load_file

    src, _ = _tiny_moe(tmp_path)
    served = convert_checkpoint(src, tmp_path / "s", Recipe(MOE_SCHEMES[fmt], (pattern,)))
    qc = json.loads((served / "config.json").read_text())["quantization_config"]
    tensors = load_file(str(served / "model.safetensors"))
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        if fmt is Format.NVFP4:
            skipped = modelopt_excludes(prefix, qc["exclude_modules"])
        else:
            skipped = is_layer_skipped(prefix, qc["ignored_layers"])
        quantized = any(n.startswith(f"{prefix}.0.gate_proj.weight_scale") for n in tensors)
        assert quantized != skipped, (prefix, pattern, qc)


@pytest.mark.parametrize("fmt", list(MOE_SCHEMES))
def test_our_expert_weights_fill_sglangs_moe_parameters_exactly(fmt: Format, tmp_path: Path) -> None:
    """Stacked SGLang's way (per expert, gate rows then up rows into w13), the weights and block
    scales we export have the shapes SGLang's MoE method allocates for them, evaluated from its
    create_weights source with the tiny MoE's sizes."""
    import types

    import torch
    from lockstep.numerics.recipe import Recipe

    _, base = _tiny_moe(tmp_path)
    layer, num_experts, inter, hidden = "model.layers.0.mlp.experts", 8, 32, 64
    scheme = MOE_SCHEMES[fmt]
    exported = dict(Recipe(scheme).export(base.items()))  # type: ignore[arg-type]
    env = {
        "num_experts": num_experts, "hidden_size": hidden, "intermediate_size_per_partition": inter,
        "w13_num_shards": 2, "num_shards": 2, "w13_up_dim": 2 * inter, "w2_up_dim": inter,
        "block_n": scheme.block[0], "block_k": scheme.block[1],
        "layer": types.SimpleNamespace(num_local_experts=num_experts),
        "self": types.SimpleNamespace(quant_config=types.SimpleNamespace(group_size=16)),
    }  # fmt: skip
    relative, cls = MOE_METHODS[fmt]
    suffixes = {
        n.removeprefix(f"{layer}.0.gate_proj.") for n in exported if n.startswith(f"{layer}.0.gate_proj.")
    }
    checked = 0
    for suffix in sorted(suffixes):
        if exported[f"{layer}.0.gate_proj.{suffix}"].dim() < 2:
            continue  # per-tensor scales (weight_scale_2, input_scale) load into per-expert slots
        w13 = torch.stack([torch.cat([exported[f"{layer}.{e}.{p}.{suffix}"] for p in ("gate_proj", "up_proj")])
                           for e in range(num_experts)])  # fmt: skip
        w2 = torch.stack([exported[f"{layer}.{e}.down_proj.{suffix}"] for e in range(num_experts)])
        for prefix, fused in (("w13_", w13), ("w2_", w2)):
            shapes = moe_parameter_shapes(relative, cls, prefix + suffix, env)
            assert tuple(fused.shape) in shapes, (prefix + suffix, tuple(fused.shape), shapes)
            checked += 1
    assert checked == 4  # weight and its block scale, for w13 and w2


def test_every_expert_tensor_a_bf16_update_carries_is_one_sglangs_moe_loader_takes(tmp_path: Path) -> None:
    """Without a low-precision recipe too: the weight pipeline of every bucketed transport (broadcast,
    cuda-ipc, p2p) sends the trainer's fused expert tensors under SGLang's per-expert names (a fused
    name would be dropped by SGLang's Qwen3-MoE load_weights without a word)."""
    from lockstep.weights.pipeline import prepare_buckets

    _, base = _tiny_moe(tmp_path)
    names = [n for b in prepare_buckets(base.items()) for n in b.names if ".experts." in n]  # type: ignore[arg-type]
    mapping = expert_params_mapping(8)
    assert len(names) == 2 * 8 * 3
    assert all(_sglang_expert_param(n, mapping) is not None for n in names), names[:4]
