"""R3 through `lockstep run`: the tiny MoE model's routed experts go engine -> sample -> trainer replay.

The engine and trainer pieces are tested on their own (runtime/tests/engine/test_engine_r3.py,
runtime/tests/train/test_fsdp_r3.py); this checks the driver wires them: every rollout request asks
for routed experts, the batch carries them, and the step reports the R3 metrics. A dense model with
r3 on is refused before anything starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from lockstep.cli import main
from lockstep.models.moe import routing_shape
from lockstep.observability.metrics import read_jsonl

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-fast.yaml"


def _manifest(tmp_path: Path, checkpoint: str) -> Path:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["model"]["checkpoint"] = checkpoint
    doc["spec"]["algorithm"]["r3"] = True
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_r3_run_replays_and_reports(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["run", str(_manifest(tmp_path, "builtin:tiny-moe")), "--run-dir", str(run_dir)]
    assert main([*args, "--cache-dir", str(tmp_path / "cache"), "--steps", "2"]) == 0
    rows = read_jsonl(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == [1, 2]
    shape = routing_shape(next((tmp_path / "cache").rglob("config.json")).parent)
    assert shape is not None
    for row in rows:
        # Payload = (tokens - 1) x layers x top-k x 4 bytes per sample: nonzero only if every request
        # asked for routed experts and the batch carried them to the trainer.
        assert row["r3_payload_bytes"] > 0
        assert row["r3_payload_bytes"] % (shape.num_layers * shape.top_k * 4) == 0
        # Engine and trainer run the same fp32 weights on one CPU: the trainer would pick the same experts.
        assert row["r3_routing_mismatch"] == pytest.approx(0.0)


def test_r3_on_a_dense_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", str(_manifest(tmp_path, "builtin:tiny")), "--run-dir", str(tmp_path / "run")]
    assert main([*args, "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert "spec.algorithm.r3" in err and "dense model" in err
