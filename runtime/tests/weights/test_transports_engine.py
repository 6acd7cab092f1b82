"""Every transport end to end into the real reference engine over HTTP on 127.0.0.1, and the pre-flight.

Broadcast runs over a real gloo group, CUDA IPC's code path runs on CPU shared memory here (the GPU
run is in test_gpu.py), P2P over Mooncake's TransferEngine on loopback TCP.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import lockstep.weights.p2p as p2p
import lockstep.weights.preflight as preflight
import pytest
import torch
from lockstep.weights.broadcast import BroadcastTransport, EngineTarget
from lockstep.weights.ipc import CudaIpcTransport
from lockstep.weights.pipeline import PipelineConfig
from lockstep.weights.transport import TransferReport
from weights_engine import EngineServer


def trainer_model(tiny_dir: Path, seed: int | None = 1) -> Any:
    """The trainer's copy: the same checkpoint after a fake step (every weight moved); seed None: the
    checkpoint as loaded (a fresh job's first update, what the pre-flight's `compare` assumes)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    if seed is None:
        return model
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    model.train(False)
    return model


def export(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in model.named_parameters()]


def assert_engine_holds(server: EngineServer, named: list[tuple[str, torch.Tensor]], version: int) -> None:
    live = server.engine.named_weights()
    assert set(live) == {n for n, _ in named}
    for name, t in named:
        assert torch.equal(live[name].cpu(), t), name
    assert server.engine.weight_version == version


class RecordingLock:
    """The stage lock, recording the engine's version at every bucket flush."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self.versions: list[int] = []

    def __enter__(self) -> None:
        self.versions.append(self.server.engine.weight_version)

    def __exit__(self, *exc: object) -> None:
        return None


def test_broadcast_gloo(engine_server: EngineServer, tiny_dir: Path) -> None:
    named = export(trainer_model(tiny_dir))
    lock = RecordingLock(engine_server)
    transport = BroadcastTransport(
        [EngineTarget(engine_server.url)],
        backend="gloo",
        config=PipelineConfig(bucket_bytes=64 * 1024),
        lock=lock,
    )
    try:
        report = transport.update_weights(named, version=1)
        assert_engine_holds(engine_server, named, 1)
        assert len(lock.versions) > 2 and set(lock.versions) == {0}  # version set only after the last bucket
        assert report.tensors == len(named)
        named2 = export(trainer_model(tiny_dir, seed=2))
        transport.update_weights(named2, version=2)  # the group is reused
        assert_engine_holds(engine_server, named2, 2)
    finally:
        transport.close()


def test_ipc_code_path_on_cpu(engine_server: EngineServer, tiny_dir: Path) -> None:
    named = export(trainer_model(tiny_dir))
    transport = CudaIpcTransport(
        engine_server.url, device="cpu", config=PipelineConfig(bucket_bytes=64 * 1024)
    )
    try:
        transport.update_weights(named, version=3)
    finally:
        transport.close()
    assert_engine_holds(engine_server, named, 3)


def test_ipc_reuses_two_buffers_and_sets_the_version_with_the_last_bucket(
    engine_server: EngineServer, tiny_dir: Path
) -> None:
    transport = CudaIpcTransport(
        engine_server.url, device="cpu", config=PipelineConfig(bucket_bytes=16 * 1024)
    )
    try:
        transport.update_weights(export(trainer_model(tiny_dir)), version=3)
        buffers = transport.buffers.allocations()
        assert 0 not in buffers  # several buckets: both buffers in use
        named = export(trainer_model(tiny_dir, seed=2))
        transport.update_weights(named, version=4)
        assert transport.buffers.allocations() == buffers  # kept across updates, not reallocated
        assert_engine_holds(engine_server, named, 4)
        # a tensor the engine refuses in the last bucket: the version stays, generation resumes
        bad = [*named[:-1], ("model.no_such.weight", named[-1][1])]
        with pytest.raises(Exception, match="no_such"):
            transport.update_weights(bad, version=5)
        assert engine_server.engine.weight_version == 4
        assert not engine_server.engine.is_paused
    finally:
        transport.close()


def test_p2p_into_engine(engine_server: EngineServer, tiny_dir: Path) -> None:
    named = export(trainer_model(tiny_dir))
    transport = p2p.P2PTransport([p2p.http_target(engine_server.url)], staging_bytes=1 << 20)
    try:
        transport.update_weights(named, version=4)
    finally:
        transport.close()
    assert_engine_holds(engine_server, named, 4)


def trainer_logprobs(model: torch.nn.Module) -> preflight.TrainerLogprobs:
    def run(prompt: list[int], response: list[int]) -> list[float]:
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(ids).logits[0].float()  # [P+R, V]
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # [R, V]
        return logp.gather(1, torch.tensor(response)[:, None])[:, 0].tolist()

    return run


PROMPT = [5, 17, 23, 42, 8, 9, 30]


@pytest.fixture
def broadcast(engine_server: EngineServer) -> Iterator[BroadcastTransport]:
    """A gloo BroadcastTransport into the engine, closed after the test."""
    transport = BroadcastTransport([EngineTarget(engine_server.url)], backend="gloo")
    try:
        yield transport
    finally:
        transport.close()


def test_preflight_passes(engine_server: EngineServer, tiny_dir: Path, broadcast: BroadcastTransport) -> None:
    model = trainer_model(tiny_dir, seed=None)
    probe = preflight.LogprobProbe(PROMPT, trainer_logprobs(model), tolerance=1e-3)
    result = preflight.check_weight_update_equal(
        [engine_server.url], broadcast, lambda: export(model), probe=probe, trainer_checksums=True
    )
    assert result.passed, result.message
    assert result.checked_tensors == len(export(model)) and result.logprob_max_abs_diff is not None
    cond = result.condition(dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
    assert (cond.type, cond.status, cond.reason) == ("PreflightPassed", "True", "WeightsEqual")
    assert preflight.PreflightResult.model_validate_json(result.model_dump_json()) == result


def test_preflight_passes_against_the_stock_engine(tiny_dir: Path) -> None:
    """Stock mode serves only what stock SGLang serves: the pre-flight needs nothing more."""
    server = EngineServer(tiny_dir, stock=True)
    transport = BroadcastTransport([EngineTarget(server.url)], backend="gloo")
    try:
        model = trainer_model(tiny_dir, seed=None)
        probe = preflight.LogprobProbe(PROMPT, trainer_logprobs(model), tolerance=1e-3)
        result = preflight.check_weight_update_equal(
            [server.url], transport, lambda: export(model), probe=probe
        )
        assert result.passed, result.message
        assert result.checked_tensors == len(export(model))  # every engine tensor checksummed
        dropped = DroppingTransport(transport, "model.norm.weight")
        again = preflight.check_weight_update_equal([server.url], dropped, lambda: export(model), version=1)
        assert [(m.name, m.reason) for m in again.mismatches] == [("model.norm.weight", "differs")]
    finally:
        transport.close()
        server.close()


def test_preflight_catches_a_dropped_tensor(
    engine_server: EngineServer, tiny_dir: Path, broadcast: BroadcastTransport
) -> None:
    model = trainer_model(tiny_dir, seed=None)
    dropped = "model.layers.1.mlp.up_proj.weight"
    result = preflight.check_weight_update_equal(
        [engine_server.url], DroppingTransport(broadcast, dropped), lambda: export(model)
    )
    assert not result.passed
    # SGLang's /weights_checker compare names it: it still holds the reset's noise, not the checkpoint.
    assert [(m.name, m.reason) for m in result.mismatches] == [(dropped, "differs")]
    assert "max_abs_err=" in result.mismatches[0].detail
    cond = result.condition(dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
    assert cond.status == "False" and cond.reason == "TensorsDiffer" and dropped in cond.message


def test_preflight_checksums_catch_a_dropped_tensor_after_a_warm_start(
    engine_server: EngineServer, tiny_dir: Path, broadcast: BroadcastTransport
) -> None:
    """Without `compare` (the trainer no longer holds the loaded checkpoint) the trainer's checksums decide."""
    model = trainer_model(tiny_dir)
    dropped = "model.norm.weight"
    result = preflight.check_weight_update_equal(
        [engine_server.url],
        DroppingTransport(broadcast, dropped),
        lambda: export(model),
        trainer_checksums=True,
        compare_loaded=False,
    )
    assert [(m.name, m.reason) for m in result.mismatches] == [(dropped, "checksum")]


class DroppingTransport:
    """Wraps a real transport and silently drops one tensor (what a buggy transport does)."""

    name = "dropping"

    def __init__(self, inner: BroadcastTransport, dropped: str) -> None:
        self.inner, self.dropped = inner, dropped

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> TransferReport:
        return self.inner.update_weights(((n, t) for n, t in named_tensors if n != self.dropped), version)

    def close(self) -> None:
        self.inner.close()


def test_preflight_probe_catches_a_skipped_post_load_step(
    engine_server: EngineServer, tiny_dir: Path, broadcast: BroadcastTransport
) -> None:
    model = trainer_model(tiny_dir, seed=None)
    # The trainer's forward sees a layout the engine never got (as if a post-load shuffle were skipped
    # on one side): checksums of the transferred tensors agree, logprobs do not.
    shuffled = trainer_model(tiny_dir, seed=None)
    with torch.no_grad():
        w = shuffled.model.layers[0].self_attn.q_proj.weight
        w.copy_(w.flip(0))
    probe = preflight.LogprobProbe(PROMPT, trainer_logprobs(shuffled), tolerance=1e-3)
    result = preflight.check_weight_update_equal(
        [engine_server.url], broadcast, lambda: export(model), probe=probe
    )
    assert not result.passed and result.mismatches == []
    assert result.condition(dt.datetime(2026, 1, 1, tzinfo=dt.UTC)).reason == "LogprobProbeFailed"


def test_p2p_commit_refuses_damaged_buffer(engine_server: EngineServer, tiny_dir: Path) -> None:
    named = export(trainer_model(tiny_dir))
    target = p2p.http_target(engine_server.url)
    with pytest.raises(p2p.P2PWriteError, match="refused"):
        target.commit(p2p.P2PCommitRequest(version=9, names=[named[0][0]], checksums={named[0][0]: "0" * 32}))
    assert engine_server.engine.weight_version == 0


def test_disk_delta_into_engine(engine_server: EngineServer, tiny_dir: Path, tmp_path: Path) -> None:
    import shutil

    import lockstep.weights.disk_delta as dd

    local = tmp_path / "local"
    shutil.copytree(tiny_dir, local)
    v0 = export(trainer_model(tiny_dir, seed=0))  # a trainer that loaded the same checkpoint ...
    v0 = [(n, engine_server.engine.named_weights()[n].clone()) for n, _ in v0]  # ... exactly
    transport = dd.DiskDeltaTransport(
        dd.DeltaPublisher(tmp_path / "root", tiny_dir), [(local, dd.http_reload(engine_server.url))]
    )
    transport.first_update(v0)
    named = export(trainer_model(tiny_dir))
    report = transport.update_weights(named, version=5)
    assert_engine_holds(engine_server, named, 5)
    assert report.extra["update_weights_wire_bytes"] == report.wire_bytes > 0


def test_disk_delta_reload_failure_is_a_delta_error_and_generation_continues(
    engine_server: EngineServer, tmp_path: Path
) -> None:
    import lockstep.weights.disk_delta as dd

    reload = dd.http_reload(engine_server.url)
    with pytest.raises(dd.DeltaError, match=r"holds no \*\.safetensors"):
        reload(tmp_path, 3)  # an empty dir: the engine refuses the update
    assert engine_server.engine.weight_version == 0 and not engine_server.engine.is_paused
