"""CUDA transports into the reference engine running as a separate process on the GPU (marked gpu).

CUDA IPC: the trainer's bf16 tensors are packed per bucket on the device and mapped by the engine;
the pre-flight check (reset, update, the trainer's checksums by name) proves every tensor arrived. NCCL broadcast:
NCCL needs a GPU per rank, so with one GPU the test is skipped with the reason. FP8 serving: the same two
paths into an engine serving a converted checkpoint, checked against the shared quantizer's served view.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lockstep.weights.preflight as preflight
import pytest
import torch
from lockstep.weights.broadcast import BroadcastTransport, EngineTarget
from lockstep.weights.ipc import CudaIpcTransport
from lockstep.weights.pipeline import PipelineConfig
from weights_subproc import EngineProcess

pytestmark = pytest.mark.gpu


def trainer_export(tiny_dir: Path) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    model = model.to("cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.01)
    return [(n, p.detach()) for n, p in model.named_parameters()]


@pytest.fixture
def cuda_engine(tiny_dir: Path) -> Iterator[EngineProcess]:
    engine = EngineProcess(tiny_dir, device="cuda", extra=["--dtype", "bfloat16"])
    yield engine
    engine.close()


def test_cuda_ipc_update_is_complete(cuda_engine: EngineProcess, tiny_dir: Path) -> None:
    named = trainer_export(tiny_dir)
    transport = CudaIpcTransport(
        cuda_engine.url, device="cuda", config=PipelineConfig(bucket_bytes=32 * 1024)
    )
    try:
        result = preflight.check_weight_update_equal(  # perturbed weights: the trainer's checksums decide
            [cuda_engine.url],
            transport,
            lambda: named,
            version=1,
            trainer_checksums=True,
            compare_loaded=False,
        )
    finally:
        transport.close()
    assert result.passed, result.message
    assert result.checked_tensors == len(named)


def test_nccl_broadcast_update_is_complete(tiny_dir: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank (trainer source + engine); this machine has one")
    engine = EngineProcess(
        tiny_dir, device="cuda", extra=["--dtype", "bfloat16"], env={"CUDA_VISIBLE_DEVICES": "1"}
    )
    named = trainer_export(tiny_dir)
    transport = BroadcastTransport([EngineTarget(engine.url)], backend="nccl", device="cuda")
    try:
        result = preflight.check_weight_update_equal(
            [engine.url], transport, lambda: named, version=1, trainer_checksums=True, compare_loaded=False
        )
    finally:
        transport.close()
        engine.close()
    assert result.passed, result.message


@pytest.fixture
def fp8_dir(tiny_dir: Path, tmp_path: Path) -> Path:
    """tiny converted by the shared quantizer (FP8 block-scaled, one BF16 exception): what an engine
    pod's convert-model step writes."""
    from lockstep.numerics.quant import Format, Scheme
    from lockstep.numerics.recipe import Recipe, convert_checkpoint

    return convert_checkpoint(tiny_dir, tmp_path / "fp8", Recipe(Scheme.of(Format.FP8), ("*.o_proj",)))


def _fp8(transport: Any) -> Any:
    from lockstep.numerics.quant import Format, Scheme
    from lockstep.numerics.recipe import Recipe
    from lockstep.weights.quantizing import QuantizingTransport

    return QuantizingTransport(transport, Recipe(Scheme.of(Format.FP8), ("*.o_proj",)))


def _check_fp8(url: str, transport: Any, named: list[tuple[str, torch.Tensor]]) -> None:
    """The pre-flight against the served view: every engine tensor equals the quantizer's values."""
    try:
        result = preflight.check_weight_update_equal(
            [url], transport, lambda: named, version=1, trainer_checksums=True, compare_loaded=False,
            allow_quant_error=True, served=transport.served,
        )  # fmt: skip
    finally:
        transport.close()
    assert result.passed, result.message
    assert result.checked_tensors == len(named)


def test_fp8_cuda_ipc_update_into_a_quantized_engine(fp8_dir: Path, tiny_dir: Path) -> None:
    """FP8 weights and their scales, packed on the device and mapped by the quantized engine."""
    engine = EngineProcess(fp8_dir, device="cuda", extra=["--dtype", "bfloat16", "--quantization", "fp8"])
    try:
        inner = CudaIpcTransport(engine.url, device="cuda", config=PipelineConfig(bucket_bytes=32 * 1024))
        _check_fp8(engine.url, _fp8(inner), trainer_export(tiny_dir))
    finally:
        engine.close()


def test_fp8_nccl_broadcast_into_a_quantized_engine(fp8_dir: Path, tiny_dir: Path) -> None:
    """FP8 bytes over NCCL (sent as uint8, received as the engine announces them)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank (trainer source + engine); this machine has one")
    engine = EngineProcess(
        fp8_dir, device="cuda", extra=["--dtype", "bfloat16", "--quantization", "fp8"],
        env={"CUDA_VISIBLE_DEVICES": "1"},
    )  # fmt: skip
    try:
        inner = BroadcastTransport([EngineTarget(engine.url)], backend="nccl", device="cuda")
        _check_fp8(engine.url, _fp8(inner), trainer_export(tiny_dir))
    finally:
        engine.close()
