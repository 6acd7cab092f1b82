"""Metrics sink (JSON lines + a real Prometheus endpoint on 127.0.0.1), the plot, and the from-disk transport."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
import torch
from lockstep.observability.metrics import MetricsSink, prom_name, read_jsonl
from lockstep.observability.plot import ASYNC_PANELS, plot_metrics
from lockstep.weights.from_disk import FromDiskTransport
from safetensors.torch import load_file


def test_jsonl_and_prometheus(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path / "m.jsonl", prometheus_port=0)
    assert sink.port == 0
    sink.log("train", 1, {"reward_mean": 0.25, "loss": math.nan})
    sink.close()
    assert read_jsonl(tmp_path / "m.jsonl") == [
        {"kind": "train", "step": 1, "reward_mean": 0.25, "loss": None}
    ]

    sink = MetricsSink(tmp_path / "m.jsonl", prometheus_port=_free_port())
    try:
        sink.log("train", 2, {"reward_mean": 0.5, "train_rollout_logprob_abs_diff": 1e-3})
        sink.log("eval", 2, {"reward_mean": 0.75})
        text = httpx.get(f"http://127.0.0.1:{sink.port}/metrics").text
    finally:
        sink.close()
    assert "lockstep_reward_mean 0.5" in text
    assert "lockstep_eval_reward_mean 0.75" in text
    assert "lockstep_train_rollout_logprob_abs_diff 0.001" in text
    assert len(read_jsonl(tmp_path / "m.jsonl", "train")) == 2  # appended, not truncated
    assert prom_name("staleness/avg") == "lockstep_staleness_avg"


def test_plot_draws_available_panels(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path / "m.jsonl")
    for step in range(1, 4):
        sink.log(
            "train", step, {"reward_mean": step / 4, "train_rollout_logprob_abs_diff": 1e-6, "queue_size": 2}
        )
    sink.close()
    out = plot_metrics(tmp_path / "m.jsonl", tmp_path / "m.png", extra_panels=ASYNC_PANELS)
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_metrics(tmp_path / "missing.jsonl", tmp_path / "x.png") is None


def test_from_disk_writes_versions_and_reloads_every_engine(tmp_path: Path) -> None:
    calls: list[tuple[str, int]] = []
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    transport = FromDiskTransport(
        tmp_path / "w", [lambda p, v: calls.append((p, v))] * 2, config_dir=tmp_path / "model", keep=2
    )
    weights = [("a.weight", torch.ones(2, 3)), ("b.bias", torch.arange(4.0))]
    for version in range(3):
        report = transport.update_weights(iter(weights), version)
    assert report.version == 2 and report.tensors == 2 and report.payload_bytes == (6 + 4) * 4
    assert report.wire_bytes == 2 * report.payload_bytes
    assert calls[-2:] == [(str(tmp_path / "w" / "weight_v000002"), 2)] * 2
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["weight_v000001", "weight_v000002"]
    saved = load_file(str(tmp_path / "w" / "weight_v000002" / "model.safetensors"))
    assert torch.equal(saved["b.bias"], torch.arange(4.0))
    assert (tmp_path / "w" / "weight_v000002" / "config.json").exists()
    with pytest.raises(ValueError, match="no tensors"):
        transport.update_weights(iter([]), 3)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_step_timestamp_shared_registries_and_the_port_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each train step stamps `lockstep_last_step_timestamp_seconds` (the no-step alert's series); a
    shared registry (the in-process session server's) is served at the same endpoint; a bad
    $LOCKSTEP_METRICS_PORT names the variable."""
    from lockstep.observability.metrics import metrics_port_from_env, share_registry
    from prometheus_client import CollectorRegistry, Counter

    shared = CollectorRegistry()
    Counter("tito_test_shared", "a shared series", registry=shared).inc(3)
    share_registry(shared)
    sink = MetricsSink(tmp_path / "m.jsonl", prometheus_port=_free_port())
    try:
        sink.log("eval", 1, {"reward_mean": 0.5})
        assert (
            "lockstep_last_step_timestamp_seconds"
            not in httpx.get(f"http://127.0.0.1:{sink.port}/metrics").text
        )
        sink.log("train", 1, {"reward_mean": 0.5})
        text = httpx.get(f"http://127.0.0.1:{sink.port}/metrics").text
    finally:
        sink.close()
    stamp = next(ln for ln in text.splitlines() if ln.startswith("lockstep_last_step_timestamp_seconds "))
    assert float(stamp.split()[1]) > 1.7e9
    assert "tito_test_shared_total 3.0" in text
    monkeypatch.setenv("LOCKSTEP_METRICS_PORT", "nine")
    with pytest.raises(ValueError, match="LOCKSTEP_METRICS_PORT='nine'"):
        metrics_port_from_env()
    monkeypatch.setenv("LOCKSTEP_METRICS_PORT", "9400")
    assert metrics_port_from_env() == 9400
