"""`lockstep run` maps a fully-async rollout whose trajectories all fail to exit code 6, naming the error.

Real engine, real trainer, the tiny fully-async fixture; only the reward plugin is broken on purpose.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lockstep.api import load_manifest
from lockstep.cli.run import execute
from lockstep.driver.settings import RunOptions
from lockstep.types import Sample

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-async.yaml"


def broken_reward(sample: Sample, response: str) -> float:
    """A reward plugin that always raises (e.g. a sandbox that is down)."""
    raise RuntimeError("sandbox unreachable")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "lockstep-cache"


def test_every_trajectory_failing_exits_6(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = FIXTURE.read_text().replace("    evalInterval: 2\n", "")
    text = text.replace(
        "spec:\n", "spec:\n  agent:\n    rewardFunction: test_async_exit_codes:broken_reward\n", 1
    )
    job = load_manifest(text)
    options = RunOptions(steps=1, cache_dir=cache_dir, engine_timeout_s=60.0)
    assert execute(job, tmp_path, options, install_signal=False) == 6
    err = capsys.readouterr().err
    assert "rollout failed" in err and "sandbox unreachable" in err
