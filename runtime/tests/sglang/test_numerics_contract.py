"""SGLang as the oracle of the numerics contract: the switches and the checkpoint format Lockstep emits.

- `sglang_args_for(spec)` (true-on-policy switches, --quantization, --kv-cache-dtype) parses with
  SGLang's own ServerArgs parser and lands in the fields SGLang reads.
- The `quantization_config` our conversion writes is the one SGLang's fp8 loader reads: its
  `Fp8Config.from_config` (read from the installed source, not imported: fp8.py pulls CUDA kernels)
  takes `quant_method`, `activation_scheme`, `weight_block_size` and `ignored_layers`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from lockstep.api import RLJobSpec
from lockstep.api.profiles import sglang_args_for
from lockstep.numerics.quant import Format, Scheme
from sglang_oracle import is_layer_skipped, parse_server_args, require_pinned_sglang, source


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
