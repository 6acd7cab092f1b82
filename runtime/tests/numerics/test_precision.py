"""The low-precision contract (§6) on builtin:tiny: four stages, one quantizer, one exception list.

Real components: the checkpoint conversion writes real safetensors, the reference engine loads them,
the FSDP2 trainer builds its forward, `lockstep run` pushes every update through the
QuantizingTransport and the from-disk transport to an engine over HTTP, and the pre-flight compares
the engine's tensors by checksum with what the shared quantizer says they must be.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from lockstep.cli import main
from lockstep.engine import ReferenceEngine
from lockstep.models.tiny import materialize_builtin
from lockstep.numerics import exact
from lockstep.numerics.quant import Format, Scheme, fake_quantize
from lockstep.numerics.recipe import Recipe, convert_checkpoint
from lockstep.observability.metrics import read_jsonl
from lockstep.train.fsdp import FSDPBackend, FSDPConfig
from safetensors.torch import load_file

FIXTURE = Path(__file__).parents[1] / "driver" / "fixtures" / "tiny-fast.yaml"
EXCEPTION = "model.layers.1.self_attn.o_proj"
QUANTIZED = "model.layers.0.mlp.up_proj"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = materialize_builtin("builtin:tiny", tmp_path_factory.mktemp("tiny"), seed=0)
    return path


@pytest.mark.parametrize("fmt", [Format.FP8, Format.MXFP8, Format.NVFP4])
def test_an_exception_stays_bf16_at_all_four_stages(tiny_dir: Path, tmp_path: Path, fmt: Format) -> None:
    recipe = Recipe(Scheme.of(fmt), (EXCEPTION,))
    base = load_file(str(tiny_dir / "model.safetensors"))
    # 1. checkpoint conversion
    served_dir = convert_checkpoint(tiny_dir, tmp_path / "served", recipe)
    converted = load_file(str(served_dir / "model.safetensors"))
    assert torch.equal(converted[f"{EXCEPTION}.weight"], base[f"{EXCEPTION}.weight"])
    assert not any(n.startswith(f"{EXCEPTION}.weight_scale") for n in converted)
    assert converted[f"{QUANTIZED}.weight"].dtype in (torch.float8_e4m3fn, torch.uint8)
    config = json.loads((served_dir / "config.json").read_text())["quantization_config"]
    assert EXCEPTION in config.get("ignored_layers", config.get("exclude_modules"))
    # 2. training forward
    backend = FSDPBackend(FSDPConfig(model_path=tiny_dir, device="cpu", train_recipe=recipe))
    try:
        modules = dict(backend.model.named_modules())
        w_exc = modules[EXCEPTION].weight.full_tensor()
        w_q = modules[QUANTIZED].weight.full_tensor()
        assert not hasattr(modules[EXCEPTION], exact.WEIGHT_VIEW_ATTR)
        assert torch.equal(
            getattr(modules[QUANTIZED], exact.WEIGHT_VIEW_ATTR)(w_q), fake_quantize(w_q, recipe.scheme)
        )
        assert torch.equal(w_exc, base[f"{EXCEPTION}.weight"])
    finally:
        backend.close()
    # 3. online export
    exported = dict(recipe.export(base.items()))
    assert torch.equal(exported[f"{EXCEPTION}.weight"], base[f"{EXCEPTION}.weight"])
    assert exported[f"{QUANTIZED}.weight"].dtype != base[f"{QUANTIZED}.weight"].dtype
    # 4. rollout: the engine serves the exception as it was, the rest exactly dequantized
    engine = ReferenceEngine.load(served_dir, context_length=64)
    assert engine.scheme == recipe.scheme
    live = engine.named_weights()
    assert torch.equal(live[f"{EXCEPTION}.weight"], base[f"{EXCEPTION}.weight"])
    assert torch.equal(live[f"{QUANTIZED}.weight"], fake_quantize(base[f"{QUANTIZED}.weight"], recipe.scheme))
    engine.load_weights(exported.items())  # an update in the export's layout
    assert torch.equal(engine.named_weights()[f"{EXCEPTION}.weight"], base[f"{EXCEPTION}.weight"])


def _run(tmp_path: Path, edits: dict[str, object], steps: int = 2) -> list[dict[str, object]]:
    doc = yaml.safe_load(FIXTURE.read_text())
    for dotted, value in edits.items():
        node = doc
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    args = [
        "run",
        str(manifest),
        "--run-dir",
        str(run_dir),
        "--cache-dir",
        str(tmp_path / "c"),
        "--steps",
        str(steps),
    ]
    assert main(args) == 0
    preflight = json.loads((run_dir / "preflight.json").read_text())
    assert preflight["passed"] and preflight["checked_tensors"] > 0, preflight
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def test_fp8_rollout_with_bf16_training_runs_end_to_end(tmp_path: Path) -> None:
    rows = _run(
        tmp_path,
        {
            "spec.rollout.precision": "fp8",
            "spec.model.bf16Modules": [EXCEPTION],
            "spec.weightSync": {"checkWeightUpdateEqual": True},
        },
    )
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # the engine serves FP8 weights, the trainer scores with its own: a small, measured gap
        assert 0.0 < r["train_rollout_logprob_abs_diff"] < 0.1, r
        assert r["mismatch_tokens"] > 0


def test_mxfp8_train_and_serve_with_true_on_policy_is_exact(tmp_path: Path) -> None:
    """Both sides see the shared quantizer's values, and the exact kernels: the diff is exactly 0."""
    rows = _run(
        tmp_path,
        {
            "spec.rollout.precision": "mxfp8",
            "spec.trainer.precision": "mxfp8",
            "spec.algorithm.trueOnPolicy": True,
            "spec.weightSync": {"checkWeightUpdateEqual": True},
        },
    )
    assert [r["train_rollout_logprob_abs_diff"] for r in rows] == [0.0, 0.0]


@pytest.mark.parametrize("transport", ["auto", "broadcast"])
def test_mxfp8_rollout_of_a_moe_model_with_quantized_experts_runs_end_to_end(
    tmp_path: Path, transport: str
) -> None:
    """builtin:tiny-moe, experts quantized per expert: each update splits the trainer's fused expert
    tensors into SGLang's per-expert pairs, the engine writes them into its fused experts, and the
    pre-flight finds every engine tensor equal to the served view."""
    rows = _run(
        tmp_path,
        {
            "spec.model.checkpoint": "builtin:tiny-moe",
            "spec.rollout.precision": "mxfp8",
            "spec.weightSync": {"transport": transport, "checkWeightUpdateEqual": True},
        },
    )
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 < r["train_rollout_logprob_abs_diff"] < 0.1 for r in rows), rows


def test_fp8_rollout_over_broadcast_runs_end_to_end(tmp_path: Path) -> None:
    """Quantized pushes travel over the broadcast transport (gloo here) too, pre-flight included."""
    rows = _run(
        tmp_path,
        {
            "spec.rollout.precision": "fp8",
            "spec.model.bf16Modules": [EXCEPTION],
            "spec.weightSync": {"transport": "broadcast", "checkWeightUpdateEqual": True},
        },
    )
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 < r["train_rollout_logprob_abs_diff"] < 0.1 for r in rows), rows


def test_precision_check_runs_the_five_steps_in_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["rollout"]["precision"] = "nvfp4"
    doc["spec"]["trainer"]["precision"] = "nvfp4"
    doc["spec"]["model"]["bf16Modules"] = [EXCEPTION]
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    args = ["precision-check", str(manifest), "--cache-dir", str(tmp_path / "c"), "--samples", "4", "--json"]
    assert main(args) == 0
    steps = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5] and all(s["passed"] for s in steps), steps
    assert steps[1]["metrics"]["exceptions"] == 1.0
    assert steps[3]["metrics"]["served_view_max_abs_diff"] < 1e-3
    assert (
        steps[3]["metrics"]["train_rollout_logprob_abs_diff"]
        < steps[3]["metrics"]["served_view_max_abs_diff"] + 1e-3
    )


@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
def test_precision_check_on_a_sharded_moe_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hf_checkpoint: Callable[[str], Path], precision: str
) -> None:
    """A real HF-layout Qwen3-MoE (sharded, with an index): mxfp8 quantizes the routed experts per
    expert at every stage (8 experts x 3 projections x 2 layers + 8 attention projections); fp8's
    [128, 128] blocks do not fit its experts (I = 32, which SGLang's Fp8MoEMethod refuses), so they
    stay BF16 at every stage (one `...mlp.experts` entry per MoE layer) and the attention is quantized."""
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["model"].update(checkpoint=str(hf_checkpoint("qwen3-moe")), family="qwen3")
    doc["spec"]["rollout"]["precision"] = precision
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    args = ["precision-check", str(manifest), "--cache-dir", str(tmp_path / "c"), "--samples", "2", "--json"]
    assert main(args) == 0
    steps = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5] and all(s["passed"] for s in steps), steps
    if precision == "mxfp8":
        assert steps[1]["metrics"] == {"quantized": 56.0, "exceptions": 0.0}, steps[1]
    else:
        assert "expert weights: intermediate size 32" in steps[1]["detail"]
        assert steps[1]["metrics"] == {"quantized": 8.0, "exceptions": 2.0}, steps[1]


def test_precision_check_needs_a_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["precision-check", str(FIXTURE)]) == 2
    assert "set spec.rollout.precision to fp8, mxfp8 or nvfp4" in capsys.readouterr().err


def test_fp8_kv_cache_is_an_engine_option(tmp_path: Path) -> None:
    """GLM-5.2's serving recipe: FP8 weights and an FP8 KV cache, BF16 (here fp32) training, end to end."""
    rows = _run(
        tmp_path,
        {
            "spec.rollout.precision": "fp8",
            "spec.rollout.kvCacheDtype": "fp8_e4m3",
            "spec.weightSync": {"checkWeightUpdateEqual": True},
        },
    )
    assert all(0.0 < r["train_rollout_logprob_abs_diff"] < 0.2 for r in rows), rows
    engine = ReferenceEngine.load(
        materialize_builtin("builtin:tiny", tmp_path / "m"), kv_cache_dtype="fp8_e4m3"
    )
    assert (
        engine.runner.k_cache.dtype == torch.float8_e4m3fn
        and engine.runner.v_cache.dtype == torch.float8_e4m3fn
    )


def test_engine_quantization_flag_must_match_the_checkpoint(tiny_dir: Path) -> None:
    """`lockstep engine --quantization` (SGLang's flag) names what the checkpoint holds; a bf16
    checkpoint is not quantized online behind the recipe's back."""
    with pytest.raises(SystemExit, match="the checkpoint holds unquantized weights"):
        main(["engine", "--model", str(tiny_dir), "--quantization", "fp8", "--port", "0"])
