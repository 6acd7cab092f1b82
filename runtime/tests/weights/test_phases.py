"""Where an update's time goes: per-phase timing on every transport, summing to the update's time.

The timer is checked exactly with an injected clock; then every transport that runs here (from-disk,
broadcast over gloo, disk-delta, P2P over TransferEngine, CUDA IPC's code path on CPU, and a
quantizing wrapper) updates the real reference engine over HTTP, and its report must name the phases
that transport has and sum them to the measured update time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import lockstep.weights.p2p as p2p
import pytest
import torch
from lockstep.serving.membership import StaticMembers
from lockstep.weights import phases
from lockstep.weights.broadcast import BroadcastTransport, EngineTarget
from lockstep.weights.disk_delta_local import LocalDiskDelta
from lockstep.weights.from_disk import MODEL_FILES, FromDiskTransport
from lockstep.weights.ipc import CudaIpcTransport
from lockstep.weights.pipeline import PipelineConfig
from lockstep.weights.transport import EngineSet, TransferReport, WeightTransport, update_members
from test_transports_engine import assert_engine_holds, export, trainer_model
from weights_engine import EngineServer


class StepClock:
    """A clock that reads `now`; tests advance it by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_innermost_open_phase_is_charged() -> None:
    clock = StepClock()
    with phases.measure(clock) as timer:
        clock.now += 1.0  # other
        with phases.phase("transfer"):
            clock.now += 2.0
            with phases.phase("engine_load"):
                clock.now += 4.0
            clock.now += 8.0
        with phases.measure(clock) as nested:  # a nested transport adds to the same timer
            assert nested is timer
            with phases.phase("pause"):
                clock.now += 16.0

        def produce() -> Iterator[str]:
            clock.now += 32.0
            yield "a"
            clock.now += 32.0
            yield "b"

        for _ in phases.timed(produce(), "gather"):
            clock.now += 64.0  # the consumer's time is not the producer's
    assert timer.done and nested.done
    expected = {"other": 1.0 + 128.0, "transfer": 10.0, "engine_load": 4.0, "pause": 16.0, "gather": 64.0}
    assert timer.seconds == expected
    assert timer.total == sum(timer.seconds.values()) == 223.0
    report = timer.stamp(TransferReport(version=1, transport="x"))
    assert report.seconds == 223.0 and report.phases == timer.seconds
    assert report.metrics()["update_weights_transfer_s"] == 10.0


def test_an_unknown_phase_is_refused_and_nothing_is_timed_outside_an_update() -> None:
    with pytest.raises(ValueError, match="unknown weight-update phase 'wire'"), phases.measure() as timer:
        timer.phase("wire").__enter__()
    with phases.phase("transfer"):  # no update in progress: a no-op
        assert phases.current() is None
    assert list(phases.timed([1, 2], "gather")) == [1, 2]
    assert phases.phases_of({"update_weights_transfer_s": 1.5, "update_weights_s": 2.0, "x": 1.0}) == {
        "transfer": 1.5
    }


def check_phases(report: TransferReport, outside_s: float, expected: set[str]) -> None:
    """The report names the transport's phases and they sum to its measured time."""
    assert expected <= set(report.phases), (expected - set(report.phases), report.phases)
    assert set(report.phases) <= set(phases.PHASES)
    assert all(s >= 0 for s in report.phases.values())
    assert math.isclose(sum(report.phases.values()), report.seconds, rel_tol=1e-9, abs_tol=1e-9)
    assert 0 < report.seconds <= outside_s  # the update's own clock lies inside the caller's
    metrics = report.metrics()
    assert metrics["update_weights_s"] == report.seconds
    assert phases.phases_of(metrics) == report.phases


def run(
    transport: WeightTransport, named: list[tuple[str, torch.Tensor]], version: int, url: str
) -> tuple[TransferReport, float]:
    engines = EngineSet(StaticMembers((url,)), [url])
    t0 = time.monotonic()
    report = update_members(transport, engines, iter(named), version)
    return report, time.monotonic() - t0


UPDATE = {"membership", "gather", "engine_load"}
"""Phases every transport's update has here."""


def test_from_disk(engine_server: EngineServer, tiny_dir: Path, tmp_path: Path) -> None:
    named = export(trainer_model(tiny_dir))
    transport = FromDiskTransport(tmp_path / "w", [], config_dir=tiny_dir, extra_files=MODEL_FILES)
    try:
        report, outside = run(transport, named, 1, engine_server.url)
    finally:
        transport.close()
    assert_engine_holds(engine_server, named, 1)
    check_phases(report, outside, UPDATE | {"bucket", "transfer"})


def test_broadcast(engine_server: EngineServer, tiny_dir: Path) -> None:
    named = export(trainer_model(tiny_dir))
    transport = BroadcastTransport(
        [EngineTarget(engine_server.url)], config=PipelineConfig(bucket_bytes=64 * 1024)
    )
    try:
        report, outside = run(transport, named, 1, engine_server.url)
        assert_engine_holds(engine_server, named, 1)
        check_phases(report, outside, UPDATE | {"convert", "bucket", "transfer", "commit", "pause", "resume"})
    finally:
        transport.close()


def test_cuda_ipc_code_path(engine_server: EngineServer, tiny_dir: Path) -> None:
    named = export(trainer_model(tiny_dir))
    transport = CudaIpcTransport(
        engine_server.url, device="cpu", config=PipelineConfig(bucket_bytes=64 * 1024)
    )
    try:
        report, outside = run(transport, named, 2, engine_server.url)
    finally:
        transport.close()
    assert_engine_holds(engine_server, named, 2)
    check_phases(report, outside, UPDATE | {"bucket", "transfer", "commit", "pause", "resume"})


def test_p2p(engine_server: EngineServer, tiny_dir: Path) -> None:
    named = export(trainer_model(tiny_dir))
    transport = p2p.P2PTransport([p2p.http_target(engine_server.url)], staging_bytes=1 << 16)
    try:
        report, outside = run(transport, named, 3, engine_server.url)
    finally:
        transport.close()
    assert_engine_holds(engine_server, named, 3)
    check_phases(report, outside, UPDATE | {"bucket", "transfer"})


def test_disk_delta(engine_server: EngineServer, tiny_dir: Path, tmp_path: Path) -> None:
    transport = LocalDiskDelta(tmp_path / "run", tiny_dir, [engine_server.url])
    try:
        first, outside = run(transport, export(trainer_model(tiny_dir)), 0, engine_server.url)
        check_phases(first, outside, UPDATE | {"transfer", "patch", "pause", "resume"})
        named = export(trainer_model(tiny_dir, seed=3))
        report, outside = run(transport, named, 1, engine_server.url)
    finally:
        transport.close()
    assert_engine_holds(engine_server, named, 1)
    check_phases(report, outside, UPDATE | {"encode", "transfer", "patch", "pause", "resume"})


def test_quantizing_wrapper_adds_its_phase(
    engine_server: EngineServer, tiny_dir: Path, tmp_path: Path
) -> None:
    from lockstep.weights.quantizing import QuantizingTransport

    class Identity:
        """A recipe that quantizes nothing, slowly enough to be seen: the wrapper's phase is its own."""

        def export(self, named: object) -> object:
            for item in named:  # type: ignore[attr-defined]
                time.sleep(0.001)
                yield item

        def decide(self, name: str, shape: tuple[int, ...]) -> object:
            class D:
                quantize = False
                reason = "not a linear weight"

            return D()

    inner = FromDiskTransport(tmp_path / "w", [], config_dir=tiny_dir, extra_files=MODEL_FILES)
    transport = QuantizingTransport(inner, Identity())  # type: ignore[arg-type]
    named = export(trainer_model(tiny_dir))
    try:
        report, outside = run(transport, named, 4, engine_server.url)
    finally:
        transport.close()
    check_phases(report, outside, UPDATE | {"quantize", "transfer"})
    assert report.phases["quantize"] >= 0.001 * len(named)  # the sleeps happened inside the phase
