"""`lockstep run` with trueOnPolicy: true: the measured train-rollout diff is exactly 0 on every step.

The whole local job (reference engine over HTTP, FSDP2 trainer, from-disk weight updates each step,
the SFT warm start) on builtin:tiny; the same job with the mode off measures a non-zero diff.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from lockstep.cli import main
from lockstep.observability.metrics import read_jsonl

FIXTURE = Path(__file__).parents[1] / "driver" / "fixtures" / "tiny-fast.yaml"


def _run(tmp_path: Path, cache: Path, on: bool, **edits: object) -> list[dict[str, object]]:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["algorithm"]["trueOnPolicy"] = on
    for dotted, value in edits.items():
        node = doc["spec"]
        *parents, last = dotted.split("__")
        for key in parents:
            node = node[key]
        node[last] = value
    manifest = tmp_path / f"job-{on}.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / f"run-{on}"
    args = ["run", str(manifest), "--run-dir", str(run_dir), "--cache-dir", str(cache), "--steps", "3"]
    assert main(args) == 0
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def test_true_on_policy_run_measures_exactly_zero_every_step(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    on = _run(tmp_path, cache, True)
    assert [r["step"] for r in on] == [1, 2, 3]
    for r in on:
        assert r["mismatch_tokens"] > 0
        assert r["train_rollout_logprob_abs_diff"] == 0.0, r
        assert r["mismatch_ratio_max"] == 1.0 and r["mismatch_ratio_min"] == 1.0
    off = _run(tmp_path, cache, False)
    assert any(r["train_rollout_logprob_abs_diff"] > 0.0 for r in off)


def test_true_on_policy_on_the_tiny_moe_with_r3_measures_exactly_zero_every_step(tmp_path: Path) -> None:
    """builtin:tiny-moe (2 MoE layers, 8 experts, top-2) with R3 replay: router and experts on the
    batch-invariant kernels on both sides, so the engine's one-token decode and the trainer's packed
    batch route every token to the same experts with the same gate values and sum the same bits."""
    cache = tmp_path / "cache"
    moe = {"model__checkpoint": "builtin:tiny-moe", "algorithm__r3": True}
    on = _run(tmp_path, cache, True, **moe)
    assert [r["step"] for r in on] == [1, 2, 3]
    for r in on:
        assert r["mismatch_tokens"] > 0 and r["r3_payload_bytes"] > 0
        assert r["train_rollout_logprob_abs_diff"] == 0.0, r
        assert r["r3_routing_mismatch"] == 0.0
    off = _run(tmp_path, cache, False, **moe)
    assert any(r["train_rollout_logprob_abs_diff"] > 0.0 for r in off)


def test_true_on_policy_refuses_mixed_devices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["algorithm"]["trueOnPolicy"] = True
    doc["spec"]["rollout"]["gpusPerEngine"] = 1
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    assert main(["run", str(manifest), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert (
        "spec.algorithm.trueOnPolicy" in err
        and "the engines and the trainer must run on the same device" in err
    )
