"""A LoRA adapter over cuda-ipc (AdapterSync mode `ipc`) into a reference engine in another process.

The cuda-ipc transport of a LoRA job sends the adapter's tensors as shared handles (CUDA IPC on the
GPU, named host shared memory on the CPU) to /load_lora_adapter_from_tensors, each tensor's sha256 in
`expected_checksums`. What must hold: the adapter pre-flight passes (every tensor checked by the
engine, the engine's base + adapter logprobs equal the trainer's peft model's), the engine lists the
version at /v1/models and samples another policy with it than the base, and the transport's close
unloads it. The CPU case runs everywhere; the CUDA case is marked gpu (one GPU: trainer and engine
share it, as colocated jobs do).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from lockstep.train.fsdp import lora
from lockstep.train.fsdp.lora import AdapterConfig
from lockstep.weights.adapter import AdapterSync, check_adapter_update
from lockstep.weights.preflight import LogprobProbe
from weights_subproc import EngineProcess

PROMPT = [2, 20, 21, 22, 3]
DEVICES = [
    pytest.param("cpu", id="cpu-shared-memory"),
    pytest.param("cuda", id="cuda-ipc", marks=pytest.mark.gpu),
]


def _peft_model(tiny_dir: Path, device: str) -> Any:
    """A rank-4 adapter on every linear layer of the tiny model, lora_B set away from zero (a fresh
    adapter is the base: the probe would not see a missing one)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = lora.attach(
        AutoModelForCausalLM.from_pretrained(tiny_dir),
        AdapterConfig(rank=4, alpha=8, target_modules=("all-linear",), name="j"),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn_like(p) * 0.05)
    return model.to(device).eval()


@pytest.fixture(params=DEVICES)
def setup(
    request: pytest.FixtureRequest, tiny_dir: Path, tmp_path: Path
) -> Iterator[tuple[str, Any, AdapterSync]]:
    device = str(request.param)
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    engine = EngineProcess(tiny_dir, device=device, extra=["--enable-lora", "--max-lora-rank", "8"])
    transport = AdapterSync("job", mode="ipc", alpha=8, root=tmp_path)
    try:
        yield engine.url, _peft_model(tiny_dir, device), transport
    finally:
        transport.close()
        engine.close()


def _loaded(url: str) -> list[str]:
    cards = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return [c["id"] for c in cards if c.get("parent") is not None]


def test_an_adapter_over_ipc_passes_the_preflight_and_is_unloaded_on_close(
    setup: tuple[str, Any, AdapterSync],
) -> None:
    url, model, transport = setup
    device = next(model.parameters()).device

    def export() -> list[tuple[str, torch.Tensor]]:
        return list(lora.adapter_tensors(model.state_dict()))

    def trainer_logprobs(prompt: list[int], response: list[int]) -> list[float]:
        ids = torch.tensor([prompt + response], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()[0]
        lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        return [float(lp[i, t]) for i, t in enumerate(response)]

    tolerance = 1e-3 if device.type == "cpu" else 0.05
    transport.follow([url])
    result = check_adapter_update(
        [url], transport, export, version=0, probe=LogprobProbe(PROMPT, trainer_logprobs, tolerance=tolerance)
    )
    assert result.passed, result.message
    assert result.checked_tensors == len(export()) and result.logprob_max_abs_diff is not None
    assert _loaded(url) == ["job-v0"]
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
        "return_logprob": True,
    }
    with_adapter = httpx.post(f"{url}/generate", json={**body, "lora_path": "job-v0"}, timeout=60).json()
    base = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    assert with_adapter["meta_info"]["output_token_logprobs"] != base["meta_info"]["output_token_logprobs"]
    transport.close()
    assert _loaded(url) == []
