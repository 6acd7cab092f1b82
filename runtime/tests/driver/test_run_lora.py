"""`lockstep run` of LoRA jobs: only the adapter trains and travels, the engine samples base + adapter.

Whole runs through the real reference engine over HTTP (and, for the shared-engine case, a
`lockstep engine` process of its own): every update reaches the engine as adapter tensors only (the
engine's base weights stay bit-identical), rollouts sample the adapter version just published (its
name `<job>-v<version>` in every /generate, per-token versions that version), the train-rollout
logprob gap stays at float noise, the pre-flight checks the adapter, checkpoints are peft adapters
and a resume continues from them. The base on disk is never written.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from lockstep.cli import main
from lockstep.models import resolve_checkpoint
from lockstep.observability.metrics import read_jsonl
from safetensors.torch import load_file

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-fast.yaml"


def _manifest(tmp_path: Path, *, name: str = "tiny-lora", checkpoint: str = "builtin:tiny", family: str = "tiny",
              transport: str = "auto") -> Path:  # fmt: skip
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["model"] = {"checkpoint": checkpoint, "family": family, "lora": {"rank": 4, "alpha": 8}}
    doc["spec"]["algorithm"]["learningRate"] = 3e-3
    doc["spec"]["weightSync"] = {"transport": transport, "checkWeightUpdateEqual": True}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _base_weights(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("transport", ["auto", "broadcast"])
def test_a_lora_run_trains_and_syncs_only_the_adapter(
    tmp_path: Path, transport: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "c"
    model_dir = Path(resolve_checkpoint("builtin:tiny", cache_dir=cache))
    base_before = _base_weights(model_dir)
    run = tmp_path / "run"
    argv = [
        "run",
        str(_manifest(tmp_path, transport=transport)),
        "--run-dir",
        str(run),
        "--cache-dir",
        str(cache),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "done: step 3" in out and "adapter tensors verified" in out
    train = read_jsonl(run / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        # only the adapter travelled: 2 matrices of rank 4 per linear layer, a few KiB
        assert 0 < r["lora_adapter_bytes"] < 200_000, r
        assert r["train_rollout_logprob_abs_diff"] < 1e-4, r  # engine base+adapter == trainer's
    # the base checkpoint on disk was never written
    after = _base_weights(model_dir)
    assert set(after) == set(base_before) and all(torch.equal(after[k], base_before[k]) for k in after)
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    assert main([*argv, "--resume", "--steps", "4"]) == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl", "train")][-1] == 4


def test_a_lora_run_on_the_qwen3_hf_fixture(
    tmp_path: Path, hf_checkpoint: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = hf_checkpoint("qwen3")
    before = _base_weights(model_dir)
    run = tmp_path / "run"
    manifest = _manifest(tmp_path, checkpoint=str(model_dir), family="qwen3")
    assert main(["run", str(manifest), "--run-dir", str(run), "--cache-dir", str(tmp_path / "c")]) == 0
    assert "adapter tensors verified" in capsys.readouterr().out
    for r in read_jsonl(run / "metrics.jsonl", "train"):
        assert r["train_rollout_logprob_abs_diff"] < 1e-4 and r["lora_adapter_bytes"] > 0, r
    after = _base_weights(model_dir)
    assert all(torch.equal(after[k], before[k]) for k in before)
