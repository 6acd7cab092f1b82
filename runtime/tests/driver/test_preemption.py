"""Preemption: SIGTERM to `lockstep run` mid-step writes a checkpoint within the grace period, and the
resumed run loses no step and skips no prompt (lockstep.driver.preemption).

The run is a real process (reference engine on 127.0.0.1, FSDP trainer, no save interval: without the
SIGTERM checkpoint every step would be lost). SIGTERM arrives while a later step's rollout runs; the
process abandons that rollout, saves the steps it trained, logs `sigterm_to_checkpoint_s` and exits 0.
The resumed run continues from exactly those steps; the data positions of every step (metrics.jsonl
`data` rows) are the uninterrupted sequence, in the sync loop and, with groups pending in the buffer,
in the fully-async loop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from lockstep.observability.metrics import read_jsonl
from lockstep.trainer.state import DriverState, latest_checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-fast.yaml"
STEPS = 6
GRACE = 60

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400), pytest.mark.heavy]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _manifest(tmp_path: Path, mode: str) -> Path:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["algorithm"].pop("sftWarmStart", None)
    doc["spec"]["schedule"] = {"steps": STEPS, "preemptionGraceSeconds": GRACE, "mode": mode}
    if mode == "fully-async":
        doc["spec"]["rollout"]["maxInFlight"] = 16  # 4 groups in flight and a full buffer at SIGTERM
        doc["spec"]["weightSync"] = {"pauseMode": "retract"}
    path = tmp_path / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _run(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("a") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "lockstep", "run", *args],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=out,
            stderr=out,
        )


def _state(run_dir: Path) -> DriverState:
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None, "no checkpoint"
    return DriverState.from_dict(json.loads((checkpoint / "trainer_state.json").read_text())["extra"])


@pytest.mark.parametrize("mode", ["sync", "fully-async"])
def test_sigterm_mid_step_checkpoints_in_the_grace_period_and_no_step_is_lost(
    tmp_path: Path, cache: Path, mode: str
) -> None:
    manifest, run_dir, log = _manifest(tmp_path, mode), tmp_path / "run", tmp_path / "run.log"
    args = [str(manifest), "--run-dir", str(run_dir), "--cache-dir", str(cache)]
    proc = _run(args, log)
    deadline = time.monotonic() + 900  # a hang guard, not a timing assertion
    while len(read_jsonl(run_dir / "metrics.jsonl", "train", raw=True)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # step 3's rollout (or its train step) is running
    assert proc.wait(timeout=GRACE) == 0, log.read_text()[-3000:]
    assert "stopped by SIGTERM" in log.read_text()
    trained = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl", "train")]
    state = _state(run_dir)
    assert state.step == max(trained) >= 2, (state, trained)  # every step it trained is in the checkpoint
    [row] = read_jsonl(run_dir / "metrics.jsonl", "preemption")
    assert 0 < row["sigterm_to_checkpoint_s"] < GRACE
    # resume: the remaining steps, and every prompt drawn exactly once
    assert _run([*args, "--resume"], log).wait(timeout=1200) == 0, log.read_text()[-3000:]
    data = read_jsonl(run_dir / "metrics.jsonl", "data")
    assert [r["step"] for r in data] == list(range(1, STEPS + 1))
    positions = [p for r in data for p in r["positions"]]
    assert max(Counter(positions).values()) == 1, positions  # nothing trained twice
    final = _state(run_dir)
    pending = {p for _, p in final.pending_groups}
    assert set(range(final.prompts_consumed)) == set(positions) | pending  # nothing skipped
    if mode == "sync":
        batch = len(data[0]["positions"])
        assert positions == list(range(STEPS * batch))  # the uninterrupted run's order, step for step
