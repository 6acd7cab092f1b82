"""End-to-end: `lockstep.driver.run` on a fully-async manifest, with the real reference engine, the FSDP
trainer on CPU, the from-disk transport, metrics file, plot and checkpoints; then a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lockstep.api import load_manifest
from lockstep.api.manifest import ManifestError
from lockstep.cli.run import execute
from lockstep.driver import run
from lockstep.driver.settings import Resume, RunOptions
from lockstep.observability.metrics import read_jsonl
from lockstep.trainer.state import DriverState, latest_checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-async.yaml"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built-in checkpoints materialized once per pytest session (shared with test_async_retract)."""
    return tmp_path_factory.getbasetemp() / "lockstep-cache"


def test_fully_async_run_and_resume(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = load_manifest(FIXTURE)
    assert str(job.spec.schedule.mode) == "fully-async"
    # What `lockstep run FIXTURE --steps 2` does (without installing its Ctrl-C handler into pytest).
    options = RunOptions(steps=2, cache_dir=cache_dir, engine_timeout_s=60.0)
    assert execute(job, tmp_path, options, install_signal=False) == 0
    assert "done: step 2" in capsys.readouterr().out
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint is not None
    state = DriverState.from_dict(json.loads((checkpoint / "trainer_state.json").read_text())["extra"])
    assert (state.step, state.version) == (2, 2)
    train = read_jsonl(tmp_path / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [1, 2]
    for key in (
        "queue_size",
        "stale_groups_filtered",
        "in_flight",
        "staleness_s_old_mean",
        "weight_version_sample_coverage",
        "mixed_version_ratio",
        "reward_mean",
        "loss",
    ):
        assert key in train[-1], key
    # The reference engine reports every token's version: full coverage, and nothing older than the bound.
    assert all(r["weight_version_sample_coverage"] == 1.0 for r in train)
    assert all(r["staleness_s_old_max"] <= 2 for r in train)
    evals = read_jsonl(tmp_path / "metrics.jsonl", "eval")
    assert [r["step"] for r in evals] == [0, 2]  # before training, then the step whose weights it scored
    assert evals[-1]["weight_version"] == 2.0 and evals[-1]["eval_latency_s"] > 0
    assert evals[-1]["mixed_versions"] == 0.0
    assert (tmp_path / "metrics.png").is_file()

    no_eval = load_manifest(FIXTURE.read_text().replace("    evalInterval: 2\n", ""))  # keeps the test short
    resumed = run(no_eval, tmp_path, RunOptions(steps=3, resume=Resume.REQUIRED, cache_dir=cache_dir))
    assert (resumed.step, resumed.version) == (3, 3)
    assert resumed.next_group_index > state.next_group_index
    assert resumed.prompts_consumed > state.prompts_consumed
    train = read_jsonl(tmp_path / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [1, 2, 3]


def test_colocate_with_fully_async_is_refused_at_load() -> None:
    text = FIXTURE.read_text().replace("colocate: false", "colocate: true")
    with pytest.raises(ManifestError, match="colocate"):
        load_manifest(text)


def test_fully_async_with_disk_delta_and_preflight(tmp_path: Path, cache_dir: Path) -> None:
    """The fully-async loop over another transport: the pre-flight runs first, then deltas land."""
    from lockstep.weights.preflight import PreflightResult

    text = FIXTURE.read_text().replace("    evalInterval: 2\n", "")
    text = text.replace("transport: auto", "transport: disk-delta\n    checkWeightUpdateEqual: true")
    final = run(load_manifest(text), tmp_path, RunOptions(steps=2, cache_dir=cache_dir))
    assert (final.step, final.version) == (2, 2)
    assert PreflightResult.model_validate_json((tmp_path / "preflight.json").read_text()).passed
    train = read_jsonl(tmp_path / "metrics.jsonl", "train")
    assert [r["weight_version"] for r in train] == [1, 2]
    assert all("update_weights_density" in r for r in train)  # updated by disk deltas
    assert sorted(p.name for p in (tmp_path / "delta").glob("weight_v*")) == [
        "weight_v000001",
        "weight_v000002",
    ]
