"""NVFP4 is w4a4: the activations of every NVFP4 layer are quantized too (SGLang's modelopt_fp4).

Golden values from the format definition (16 values per E4M3 scale amax / 6 / input_scale, E2M1
nearest-even, saturating at 6), SGLang's parameter names (`input_scale` next to each NVFP4 weight,
`w13_input_scale` / `w2_input_scale` for a MoE layer), and the reference engine computing exactly
that on a real converted checkpoint (emulated in float32: no FP4 tensor cores here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lockstep.engine import ReferenceEngine
from lockstep.models.tiny import materialize_builtin
from lockstep.numerics import experts, quant
from lockstep.numerics.quant import NVFP4_INPUT_SCALE, Format, Scheme, fake_quantize_activation
from lockstep.numerics.recipe import Recipe, convert_checkpoint
from safetensors.torch import load_file, save_file

NVFP4 = Scheme.of(Format.NVFP4)


def test_activation_golden_values_follow_the_format_definition() -> None:
    # block 1: amax 12 -> scale E4M3(12 / 6) = 2; x / 2 rounds to E2M1 with ties to the even code
    half = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0]
    want1 = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0, 0.0]
    # block 2: amax 6.375 -> 6.375 / 6 = 1.0625 is an E4M3 tie, rounded to 1.0; 6.375 then saturates at 6
    block2 = [6.375] + [0.0] * 15
    x = torch.tensor([[2 * v for v in half] + block2])
    got = fake_quantize_activation(x, 1.0)
    assert got[0, :16].tolist() == [2 * v for v in want1]
    assert got[0, 16].item() == 6.0 and got[0, 17:].abs().sum() == 0
    # the global scale divides the block scale: with input_scale 0.5 the E4M3 scale is 2 * amax / 6
    y = torch.tensor([[0.9] + [0.0] * 15])  # 0.9 / 6 / 0.5 = 0.3 -> E4M3 0.3125 -> eff 0.15625
    assert fake_quantize_activation(y, 0.5)[0, 0].item() == pytest.approx(
        6 * 0.15625
    )  # 0.9 / 0.15625 = 5.76 -> 6


def test_activations_need_whole_blocks() -> None:
    with pytest.raises(ValueError, match="not a multiple of 16"):
        fake_quantize_activation(torch.ones(2, 24), 1.0)


def test_every_nvfp4_layer_carries_sglangs_input_scale() -> None:
    pairs = dict(quant.to_checkpoint("m.q_proj.weight", quant.quantize(torch.randn(32, 64), NVFP4)))
    assert (
        pairs["m.q_proj.input_scale"].item() == NVFP4_INPUT_SCALE and pairs["m.q_proj.input_scale"].dim() == 0
    )
    # a ModelOpt checkpoint without one loads with SGLang's default (its parameter's fill value, 1.0)
    del pairs["m.q_proj.input_scale"]
    q, used = quant.from_checkpoint("m.q_proj.weight", pairs, NVFP4)
    assert q is not None and q.input_scale is not None and q.input_scale.item() == 1.0
    assert "m.q_proj.input_scale" not in used


def _module(name: str) -> str:
    x = experts.parse(name)
    return x.layer if x is not None else name.removesuffix(".weight")


def _reference_logits(model: torch.nn.Module, served: dict[str, torch.Tensor], quantized: set[str],
                      ids: torch.Tensor, acts: bool) -> torch.Tensor:  # fmt: skip
    """The served weights in a fresh transformers model, each quantized Linear's input fake-quantized
    by hand (acts), the experts' computed by experts.install_forward with the same rule."""
    model.load_state_dict(served, strict=False)
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name in quantized and acts:
            m.register_forward_pre_hook(lambda _m, a: (fake_quantize_activation(a[0], 1.0),))
        elif name in quantized and acts:
            hooks = experts.ExpertsHooks(
                gate_up_input=lambda x: fake_quantize_activation(x, 1.0),
                down_input=lambda x: fake_quantize_activation(x, 1.0),
            )
            experts.install_forward(m, hooks)
    with torch.no_grad():
        return model(ids).logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("builtin", ["builtin:tiny", "builtin:tiny-moe"])
def test_the_reference_engine_quantizes_nvfp4_activations(builtin: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = materialize_builtin(builtin, tmp_path / "src", seed=0)
    recipe = Recipe(NVFP4)
    served_dir = convert_checkpoint(src, tmp_path / "served", recipe)
    base = load_file(str(src / "model.safetensors"))
    served = dict(recipe.served(base.items()))
    quantized = {_module(n) for n, t in base.items() if recipe.quantizes(n, tuple(t.shape))}
    engine = ReferenceEngine.load(served_dir, context_length=64)
    ids = torch.tensor([[3, 10, 20, 30, 40, 50, 60, 70, 5, 9]])
    with torch.no_grad():
        got = engine.model(ids).logits
    w4a4 = _reference_logits(AutoModelForCausalLM.from_pretrained(src), served, quantized, ids, acts=True)
    w4a16 = _reference_logits(AutoModelForCausalLM.from_pretrained(src), served, quantized, ids, acts=False)
    # the same computation up to CPU BLAS noise (two model instances' storage alignment can pick
    # different kernels: ~1e-8); dropping the activation quantization moves the logits by ~1e-1
    assert float((got - w4a4).abs().max()) < 1e-5
    assert float((got - w4a16).abs().max()) > 1e-2  # the activations are quantized, not only the weights
    # the engine computes with the input scale that arrived: an update carrying another one changes it
    name = "model.layers.0.self_attn.o_proj"
    update = dict(recipe.export([(f"{name}.weight", base[f"{name}.weight"])]))
    update[f"{name}.input_scale"] = torch.tensor(0.01)
    engine.load_weights(update.items())
    with torch.no_grad():
        assert not torch.equal(engine.model(ids).logits, got)


def test_an_engine_refuses_an_nvfp4_update_without_its_input_scale(tmp_path: Path) -> None:
    src = materialize_builtin("builtin:tiny", tmp_path / "src", seed=0)
    recipe = Recipe(NVFP4)
    engine = ReferenceEngine.load(convert_checkpoint(src, tmp_path / "served", recipe), context_length=64)
    name = "model.layers.0.mlp.down_proj"
    update = dict(
        recipe.export([(f"{name}.weight", load_file(str(src / "model.safetensors"))[f"{name}.weight"])])
    )
    del update[f"{name}.input_scale"]
    with pytest.raises(ValueError, match=rf"{name}.input_scale missing"):
        engine.load_weights(update.items())
    save_file(update, str(tmp_path / "x.safetensors"))  # what arrived is still a loadable ModelOpt layer


def test_nvfp4_train_and_serve_quantizes_activations_on_both_sides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lockstep precision-check` on builtin:tiny-moe in NVFP4 (trainer and engines) with true
    on-policy: the trainer's forward quantizes the same weights and activations as the engine, on the
    same kernels, so the logprobs of the sampled tokens are equal to the bit (without the trainer's
    activation quantization they are ~1e-2 apart)."""
    import json

    import yaml
    from lockstep.cli import main

    doc = yaml.safe_load((Path(__file__).parents[1] / "driver" / "fixtures" / "tiny-fast.yaml").read_text())
    doc["spec"]["model"]["checkpoint"] = "builtin:tiny-moe"
    doc["spec"]["rollout"]["precision"] = doc["spec"]["trainer"]["precision"] = "nvfp4"
    doc["spec"]["algorithm"]["trueOnPolicy"] = True
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    args = ["precision-check", str(manifest), "--cache-dir", str(tmp_path / "c"), "--samples", "2", "--json"]
    assert main(args) == 0
    steps = json.loads(capsys.readouterr().out)
    assert all(s["passed"] for s in steps), steps
    assert steps[1]["metrics"]["quantized"] == 56.0  # 8 attention projections + 2 x 8 x 3 expert weights
    assert steps[3]["metrics"]["served_view_max_abs_diff"] == 0.0
    assert steps[3]["metrics"]["train_rollout_logprob_abs_diff"] == 0.0


def test_an_nvfp4_checkpoint_without_input_scales_is_served_w4a4_under_sglangs_default(
    tmp_path: Path,
) -> None:
    """A ModelOpt checkpoint that carries no input_scale: SGLang quantizes the activations under its
    parameter's fill value 1.0, and so does the reference engine."""
    src = materialize_builtin("builtin:tiny", tmp_path / "src", seed=0)
    served_dir = convert_checkpoint(src, tmp_path / "served", Recipe(NVFP4))
    ids = torch.tensor([[3, 10, 20, 30, 40, 50]])
    with torch.no_grad():
        want = ReferenceEngine.load(served_dir, context_length=64).model(ids).logits
    tensors = load_file(str(served_dir / "model.safetensors"))
    save_file(
        {n: t for n, t in tensors.items() if not n.endswith(".input_scale")},
        str(served_dir / "model.safetensors"),
    )
    with torch.no_grad():
        got = ReferenceEngine.load(served_dir, context_length=64).model(ids).logits
    assert float((got - want).abs().max()) < 1e-5  # (two engine instances: CPU BLAS noise at most)


def test_a_fused_layer_quantizes_its_input_under_the_max_of_its_shards_input_scales(tmp_path: Path) -> None:
    """SGLang's ModelOptFp4LinearMethod keeps one input scale per fused layer (qkv_proj: the max of
    q's, k's and v's); a checkpoint whose shards carry different ones is served that way here too."""
    src = materialize_builtin("builtin:tiny", tmp_path / "src", seed=0)
    served_dir = convert_checkpoint(src, tmp_path / "served", Recipe(NVFP4))
    tensors = load_file(str(served_dir / "model.safetensors"))
    attn = "model.layers.0.self_attn"
    for proj, s in (("q_proj", 0.3), ("k_proj", 1.7), ("v_proj", 0.6)):  # not powers of 2 apart
        tensors[f"{attn}.{proj}.input_scale"] = torch.tensor(s)
    save_file(tensors, str(served_dir / "model.safetensors"))
    engine = ReferenceEngine.load(served_dir, context_length=64)
    q = dict(engine.model.named_modules())[f"{attn}.q_proj"]
    x = torch.randn(3, 64) * 4
    with torch.no_grad():
        got = q(x)
        want = torch.nn.functional.linear(fake_quantize_activation(x, 1.7), q.weight)
        own = torch.nn.functional.linear(fake_quantize_activation(x, 0.3), q.weight)
    assert torch.equal(got, want) and not torch.equal(got, own)
