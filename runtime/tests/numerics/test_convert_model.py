"""`lockstep convert-model`: the engine pods' conversion step (§6 stage 1) on real HF-layout checkpoints.

The fixtures are sharded safetensors with an index (Qwen3, Qwen3-MoE, GLM-5 at tiny sizes); the
converted checkpoint keeps the shards and the index, declares SGLang's `quantization_config`, and the
reference engine loaded from it serves exactly the shared quantizer's values (exceptions as they were).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lockstep.cli import main
from lockstep.engine import ReferenceEngine
from lockstep.numerics.quant import Format, Scheme, fake_quantize
from lockstep.numerics.recipe import Recipe
from safetensors.torch import load_file


def _weights(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe", "glm5"])
def test_converted_checkpoint_serves_the_quantizers_values(
    family: str, hf_checkpoint: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = hf_checkpoint(family)
    exception = "model.layers.0.mlp.down_proj" if family != "qwen3-moe" else "model.layers.0.self_attn.o_proj"
    dest = tmp_path / "serving" / "fp8"
    dest.parent.mkdir()
    args = ["convert-model", str(src), "--dest", str(dest), "--precision", "fp8", "--bf16-modules", exception]
    assert main(args) == 0
    assert f"into {dest}" in capsys.readouterr().out
    assert [p.name for p in dest.parent.iterdir()] == ["fp8"]  # no temp directory left behind
    # shards and index as the source had them; tokenizer files copied
    assert sorted(p.name for p in dest.glob("*.safetensors")) == sorted(
        p.name for p in src.glob("*.safetensors")
    )
    index = json.loads((dest / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(_weights(dest)) and (dest / "tokenizer.json").is_file()
    config = json.loads((dest / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and exception in config["ignored_layers"]
    recipe = Recipe(Scheme.of(Format.FP8), (exception,))
    base = _weights(src)
    engine = ReferenceEngine.load(dest, context_length=64)
    live = engine.named_weights()
    quantized = [n for n, t in base.items() if recipe.quantizes(n, tuple(t.shape))]
    assert quantized and f"{exception}.weight" not in quantized
    for name in quantized:  # every scale sits in its weight's shard
        assert index[name] == index[name.removesuffix(".weight") + ".weight_scale_inv"]
        assert torch.equal(live[name], fake_quantize(base[name].float(), recipe.scheme)), name
    assert torch.equal(live[f"{exception}.weight"], base[f"{exception}.weight"].float())
    if family == "glm5":  # SGLang's GLM-5 layers: MLA's fused q_a / kv_a_with_mqa and the DSA indexer
        attn = "model.layers.1.self_attn"
        for name in ("q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj", "indexer.wq_b", "indexer.wk"):
            assert f"{attn}.{name}.weight" in quantized, name
        assert f"{attn}.indexer.weights_proj.weight" not in quantized  # SGLang builds it unquantized
        # fp8 [128, 128] blocks do not fit its experts (I = 32: SGLang's Fp8MoEMethod refuses it): one BF16 MoE layer
        assert "model.layers.1.mlp.experts" in config["ignored_layers"]


def test_a_converted_directory_is_kept_and_bad_input_names_the_fix(
    hf_checkpoint: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dest = hf_checkpoint("qwen3"), tmp_path / "nvfp4"
    assert main(["convert-model", str(src), "--dest", str(dest), "--precision", "nvfp4"]) == 0
    before = (dest / "config.json").stat().st_mtime_ns
    capsys.readouterr()
    # a second engine pod on the same volume: the directory is there, nothing is rewritten
    assert main(["convert-model", str(src), "--dest", str(dest), "--precision", "nvfp4"]) == 0
    assert "already there" in capsys.readouterr().out
    assert (dest / "config.json").stat().st_mtime_ns == before
    assert (
        main(["convert-model", str(tmp_path / "none"), "--dest", str(tmp_path / "x"), "--precision", "fp8"])
        == 2
    )
    err = capsys.readouterr().err
    assert "SRC" in err and "not an HF-layout checkpoint" in err and not (tmp_path / "x").exists()
