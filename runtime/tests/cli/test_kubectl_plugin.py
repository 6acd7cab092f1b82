"""`kubectl lockstep` without a cluster: the metrics text it reads, what `status` prints, and kubectl's
absence named with the fix. e2e/test_prometheus.py runs it against the real cluster."""

from __future__ import annotations

from typing import Any

import pytest
from lockstep.cli import kubectl as plugin

TEXT = """# HELP lockstep_step train metric step (latest step)
# TYPE lockstep_step gauge
lockstep_step 7.0
lockstep_reward_mean 0.375
lockstep_last_step_timestamp_seconds 1.0e9
tito_session_mismatch_total{type="text"} 2.0
"""


def _pod(name: str, role: str, ready: bool, restarts: int = 0) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"rl.lockstep.dev/role": role}},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}],
                   "containerStatuses": [{"restartCount": restarts}]},
    }  # fmt: skip


def test_metrics_text_keeps_unlabelled_series() -> None:
    assert plugin.parse_metrics(TEXT) == {
        "lockstep_step": 7.0,
        "lockstep_reward_mean": 0.375,
        "lockstep_last_step_timestamp_seconds": 1.0e9,
    }


def test_status_lines() -> None:
    job = {
        "metadata": {"name": "tiny", "namespace": "ns"},
        "spec": {"schedule": {"steps": 40}},
        "status": {"phase": "Running", "step": 7, "weightVersion": 7, "reward": 0.4,
                   "conditions": [{"type": "Degraded", "status": "False", "reason": "Healthy", "message": "ok"}]},
    }  # fmt: skip
    lines = plugin.status_lines(
        job, [_pod("tiny-driver", "driver", True), _pod("tiny-rollout-0", "engine", False, 2)],
        plugin.parse_metrics(TEXT),
    )  # fmt: skip
    assert lines[0].startswith("RLJob ns/tiny: phase Running, step 7/40, weight version 7, reward 0.4")
    assert lines[1] == "  Degraded=False Healthy: ok"
    assert "tiny-rollout-0" in lines[4] and "Running" in lines[4] and "restarts 2" in lines[4]
    assert lines[-1].startswith("driver metrics (last step): step 7, reward_mean 0.375, last step ")
    no_step = plugin.status_lines(job, [], {})
    assert no_step[-1] == "driver metrics (last step): none yet (no RL step)"


def test_missing_kubectl_names_the_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert plugin.main(["status", "tiny"]) == 1
    assert "kubectl is not on PATH: install it" in capsys.readouterr().err
