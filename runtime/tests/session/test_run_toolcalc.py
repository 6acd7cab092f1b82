"""`lockstep run` trains on the multi-turn toolcalc task through the in-process TITO session server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
MANIFEST = REPO / "runtime/tests/session/fixtures/tiny-tools.yaml"


@pytest.mark.slow
def test_lockstep_run_trains_one_step_on_toolcalc(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "lockstep", "run", str(MANIFEST), "--steps", "1", "--run-dir", str(tmp_path)]
    cmd += ["--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    assert rows, "no metrics were written"
    # The agent's requests to the session server are logged by httpx (the driver logs at INFO).
    assert "/v1/chat/completions" in done.stderr + done.stdout, (
        "the toolcalc agent never reached the session server"
    )
