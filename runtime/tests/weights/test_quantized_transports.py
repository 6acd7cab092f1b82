"""Quantized weights over every transport into a real quantized reference engine (§6, stage 3 -> 4).

Each transport carries what the shared quantizer exports (SGLang's checkpoint layout: the FP8/FP4
`weight` plus its scales) and the engine, loaded from the converted checkpoint, dequantizes exactly
what arrived: after an update it holds bit for bit what `Recipe.served` says, BF16 exceptions as they
were sent. Broadcast runs over a real gloo group (FP8 bytes travel as uint8, which gloo carries), CUDA
IPC's code path on CPU shared memory, disk-delta through real files and reloads, P2P over Mooncake's
TransferEngine on loopback TCP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lockstep.weights.p2p as p2p
import pytest
import torch
from lockstep.numerics.quant import Format, Scheme
from lockstep.numerics.recipe import Recipe, convert_checkpoint
from lockstep.weights.broadcast import BroadcastTransport, EngineTarget
from lockstep.weights.disk_delta_local import LocalDiskDelta
from lockstep.weights.ipc import CudaIpcTransport
from lockstep.weights.pipeline import PipelineConfig
from lockstep.weights.quantizing import QuantizingTransport
from lockstep.weights.transport import WeightTransport
from test_transports_engine import export, trainer_model
from weights_engine import EngineServer

EXCEPTION = "model.layers.1.self_attn.o_proj"
"""A configured BF16 exception: it must arrive and be served unquantized."""
BUCKET = PipelineConfig(bucket_bytes=64 * 1024)
"""Small buckets: many flushes, each keeping a weight with its scales."""


def _transport(kind: str, url: str, run_dir: Path, model_dir: Path) -> WeightTransport:
    if kind == "broadcast":
        return BroadcastTransport([EngineTarget(url)], backend="gloo", config=BUCKET)
    if kind == "cuda-ipc":
        return CudaIpcTransport(url, device="cpu", config=BUCKET)
    if kind == "disk-delta":
        return LocalDiskDelta(run_dir, model_dir, [url])
    return p2p.P2PTransport([p2p.http_target(url)], staging_bytes=1 << 20)


TRANSPORTS = ["broadcast", "cuda-ipc", "disk-delta", "p2p"]


@pytest.fixture(scope="module", params=[Format.FP8, Format.MXFP8, Format.NVFP4])
def served(
    request: pytest.FixtureRequest, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Recipe, Path]:
    recipe = Recipe(Scheme.of(request.param), (EXCEPTION,))
    return recipe, convert_checkpoint(tiny_dir, tmp_path_factory.mktemp(f"served-{request.param}"), recipe)


@pytest.fixture
def quantized_engine(served: tuple[Recipe, Path]) -> Iterator[EngineServer]:
    server = EngineServer(served[1], allow_tensor_updates=True)
    try:
        yield server
    finally:
        server.close()


def _holds(server: EngineServer, expected: dict[str, torch.Tensor], version: int) -> None:
    live = server.engine.named_weights()
    assert set(live) == set(expected)
    differ = [n for n, t in expected.items() if not torch.equal(live[n].cpu(), t)]
    assert not differ, f"{len(differ)} tensors differ from the quantizer's served values: {differ[:5]}"
    assert server.engine.weight_version == version


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_every_transport_carries_quantized_weights_bit_exactly(
    kind: str, served: tuple[Recipe, Path], quantized_engine: EngineServer, tiny_dir: Path, tmp_path: Path
) -> None:
    recipe, _ = served
    transport = QuantizingTransport(_transport(kind, quantized_engine.url, tmp_path, tiny_dir), recipe)
    try:
        for version, seed in ((1, 1), (2, 2)):  # disk-delta: a baseline, then a real delta
            named = export(trainer_model(tiny_dir, seed=seed))
            report = transport.update_weights(named, version)
            assert report.extra["update_weights_quantized_tensors"] > 0
            assert report.extra["update_weights_bf16_exceptions"] == 1.0
            expected = dict(recipe.served(named))
            _holds(quantized_engine, expected, version)
            # the exception was sent and is served as it was, unquantized
            assert torch.equal(
                quantized_engine.engine.named_weights()[f"{EXCEPTION}.weight"],
                dict(named)[f"{EXCEPTION}.weight"],
            )
    finally:
        transport.close()


def _refused(call: Callable[[], Any], server: EngineServer, match: str) -> None:
    before = {n: t.clone() for n, t in server.engine.named_weights().items()}
    with pytest.raises(ValueError, match=match):
        call()
    after = server.engine.named_weights()
    assert all(torch.equal(after[n], t) for n, t in before.items())  # nothing half-applied


def test_a_quantized_weight_without_its_scale_is_refused(
    served: tuple[Recipe, Path], quantized_engine: EngineServer, tiny_dir: Path
) -> None:
    recipe, _ = served
    exported = dict(recipe.export(export(trainer_model(tiny_dir))))
    name = "model.layers.0.mlp.up_proj.weight"
    lone = [(name, exported[name])]
    _refused(
        lambda: quantized_engine.engine.load_weights(lone, cast=True), quantized_engine, "travel together"
    )


def test_an_unquantized_push_into_a_quantized_engine_is_refused(
    served: tuple[Recipe, Path], quantized_engine: EngineServer, tiny_dir: Path
) -> None:
    """Without the QuantizingTransport the engine gets BF16 values where it serves FP8 bytes: refused,
    never cast (this is the test that fails when the engine stops checking)."""
    named = export(trainer_model(tiny_dir))
    transport = BroadcastTransport([EngineTarget(quantized_engine.url)], backend="gloo", config=BUCKET)
    try:
        with pytest.raises(Exception, match="converted checkpoint's layout"):
            transport.update_weights(named, 1)
    finally:
        transport.close()
    assert quantized_engine.engine.weight_version == 0


@pytest.fixture(scope="module")
def moe_served(tmp_path_factory: pytest.TempPathFactory) -> tuple[Recipe, Path, Path]:
    """builtin:tiny-moe converted to MXFP8 (expert weights quantized per expert)."""
    from lockstep.models.tiny import materialize_builtin

    src = materialize_builtin("builtin:tiny-moe", tmp_path_factory.mktemp("moe"), seed=0)
    recipe = Recipe(Scheme.of(Format.MXFP8))
    return recipe, src, convert_checkpoint(src, tmp_path_factory.mktemp("moe-served"), recipe)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_every_transport_carries_quantized_expert_weights_per_expert(
    kind: str, moe_served: tuple[Recipe, Path, Path], tmp_path: Path
) -> None:
    """The trainer's fused expert tensors leave as SGLang's per-expert pairs over every transport,
    and the engine, writing them into its fused experts, holds the served view bit for bit."""
    recipe, src, served_dir = moe_served
    server = EngineServer(served_dir, allow_tensor_updates=True)
    transport = QuantizingTransport(_transport(kind, server.url, tmp_path, src), recipe)
    try:
        for version, seed in ((1, 1), (2, 2)):
            named = export(trainer_model(src, seed=seed))
            assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in named)  # fused in the trainer
            transport.update_weights(named, version)
            _holds(server, dict(recipe.served(named)), version)
    finally:
        transport.close()
        server.close()


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_every_transport_carries_bf16_expert_weights_per_expert(
    kind: str, moe_served: tuple[Recipe, Path, Path], tmp_path: Path
) -> None:
    """No recipe: the bucketed transports send the fused expert tensors under SGLang's per-expert
    names too (the pipeline's hf_converter), and a BF16 engine writes them into its fused experts."""
    _, src, _ = moe_served
    server = EngineServer(src, allow_tensor_updates=True)
    transport = _transport(kind, server.url, tmp_path, src)
    try:
        named = export(trainer_model(src, seed=3))
        transport.update_weights(named, 1)
        _holds(server, dict(named), 1)
    finally:
        transport.close()
        server.close()
