"""check_transport: which spec.weightSync.transport settings a run refuses before anything starts (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from lockstep.api import RLJob, load_manifest
from lockstep.config.trainer import transport_config
from lockstep.weights.factory import TransportConfig, check_transport, needs_tensor_updates

FIXTURE = Path(__file__).parents[1] / "driver" / "fixtures" / "tiny-fast.yaml"


def _job(transport: str, device: str = "cpu", replicas: int = 1) -> RLJob:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["weightSync"] = {"transport": transport}
    doc["spec"]["schedule"]["colocate"] = transport == "cuda-ipc"
    doc["spec"]["trainer"]["device"] = device
    doc["spec"]["rollout"]["replicas"] = replicas
    return load_manifest(yaml.safe_dump(doc))


def _config(transport: str, device: str = "cpu", replicas: int = 1) -> TransportConfig:
    return transport_config(_job(transport, device, replicas))


@pytest.mark.parametrize("transport", ["auto", "broadcast", "disk-delta", "p2p"])
@pytest.mark.parametrize("external", [False, True])
def test_other_transports_always_start(transport: str, external: bool) -> None:
    check_transport(_config(transport), external_engines=external, cuda_available=False)
    assert not needs_tensor_updates(_config(transport))


@pytest.mark.parametrize(
    ("device", "replicas", "external", "cuda", "refusal"),
    [
        ("cpu", 1, False, False, None),  # host shared memory with the in-process engine
        ("cpu", 1, True, False, "host memory with an engine of this process only"),
        ("cuda", 1, False, False, "needs a CUDA device"),
        ("cuda", 1, False, True, "needs the engine in another process"),
        ("cuda", 1, True, True, None),
    ],
)
def test_cuda_ipc_refusals_name_the_field(
    device: str, replicas: int, external: bool, cuda: bool, refusal: str | None
) -> None:
    job = _config("cuda-ipc", device, replicas)
    assert needs_tensor_updates(job)
    if refusal is None:
        check_transport(job, external_engines=external, cuda_available=cuda)
        return
    with pytest.raises(ValueError, match=r"spec\.weightSync\.transport: cuda-ipc") as e:
        check_transport(job, external_engines=external, cuda_available=cuda)
    assert refusal in str(e.value)


@pytest.mark.parametrize(
    ("engine", "declared", "refused"),
    [("sglang", False, True), ("sglang", True, False), ("reference", False, False)],
)
def test_p2p_into_stock_sglang_is_refused_at_apply_with_the_fix(
    engine: str, declared: bool, refused: bool
) -> None:
    """Stock SGLang has no P2P receive side: p2p needs an engine image that declares it (docs/sglang.md).
    The manifest alone decides it, so the API refuses it (rule p2p-needs-a-receiver), never the start."""
    from lockstep.api import ManifestError

    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["weightSync"] = {"transport": "p2p"}
    doc["spec"]["rollout"].update(engine=engine, p2pReceiver=declared)
    if refused:
        with pytest.raises(ManifestError, match=r"spec\.rollout\.p2pReceiver: false: p2p writes"):
            load_manifest(yaml.safe_dump(doc))
        return
    check_transport(
        transport_config(load_manifest(yaml.safe_dump(doc))), external_engines=True, cuda_available=False
    )


@pytest.mark.parametrize("transport", ["auto", "broadcast", "disk-delta", "p2p", "cuda-ipc"])
@pytest.mark.parametrize("precision", ["fp8", "mxfp8", "nvfp4"])
def test_quantized_serving_starts_on_every_transport(transport: str, precision: str) -> None:
    """The QuantizingTransport wraps whichever transport is built: no start-time refusal is left."""
    job = _job(transport)
    wire = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    wire["spec"]["rollout"]["precision"] = precision
    wire["spec"]["trainer"]["precision"] = "nvfp4" if precision == "nvfp4" else "bf16"
    config = transport_config(load_manifest(yaml.safe_dump(wire)))
    check_transport(config, external_engines=False, cuda_available=False)
