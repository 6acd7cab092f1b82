"""Sampling parameters at the precision the kernels use, through the engine's real HTTP server.

`temperature=1e-40` and `top_p=1e-300` used to pass validation (they are finite, positive float64
values), become subnormal or zero in the step's float32 tensors, and make the batched sampling throw:
every other request of that step was aborted. Now they are refused with a 400 naming the field while
concurrent valid requests run to their full budget, the weights are byte-identical and no step fails;
a temperature below SGLang's 1e-6 samples greedily as SGLang does; and a row that cannot be sampled
at step time (non-finite logits) fails alone.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from aiohttp.test_utils import TestServer
from lockstep.engine import ReferenceEngine, create_app
from lockstep.engine.row_sampling import sample_rows
from lockstep.engine.runner import SamplingBatch

PROMPT = [2, 20, 21, 22, 23, 3, 5, 6, 7]


@pytest.fixture
async def served(tiny_dir: Path) -> AsyncIterator[tuple[ReferenceEngine, httpx.AsyncClient]]:
    engine = ReferenceEngine.load(tiny_dir, max_running_requests=8, context_length=256, seed=0)
    server = TestServer(create_app(engine), host="127.0.0.1")
    await server.start_server()
    async with httpx.AsyncClient(base_url=str(server.make_url("")).rstrip("/"), timeout=120) as http:
        try:
            yield engine, http
        finally:
            await server.close()


def _digest(engine: ReferenceEngine) -> str:
    h = hashlib.sha256()
    for name, t in sorted(engine.named_weights().items()):
        h.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _body(max_new: int = 4, **sp: Any) -> dict[str, Any]:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, **sp}}


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("temperature", 1e-40, "underflows float32"),
        ("top_p", 1e-300, "underflows float32"),
        ("temperature", 1e39, "overflows float32"),
    ],
)
async def test_a_value_float32_cannot_carry_is_refused_and_fails_no_other_request(
    served: tuple[ReferenceEngine, httpx.AsyncClient], field: str, value: float, needle: str
) -> None:
    engine, http = served
    before = _digest(engine)
    valid = [asyncio.create_task(http.post("/generate", json=_body(24, temperature=1.0))) for _ in range(3)]
    while engine.stats.generated_tokens < 3:  # the valid requests are mid-generation
        await asyncio.sleep(0.001)
    bad = await http.post("/generate", json=_body(**{field: value}))
    assert bad.status_code == 400, bad.text
    assert f"sampling_params.{field}" in bad.text and needle in bad.text, bad.text
    for r in await asyncio.gather(*valid):
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 24
    assert engine.stats.failed_steps == 0 and engine.stats.failed_rows == 0
    assert _digest(engine) == before


async def test_a_temperature_below_sglangs_epsilon_samples_greedily(
    served: tuple[ReferenceEngine, httpx.AsyncClient],
) -> None:
    _, http = served
    greedy = await http.post("/generate", json=_body(8, temperature=0.0))
    tiny = await http.post("/generate", json=_body(8, temperature=1e-30))  # normal in float32
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["output_ids"] == greedy.json()["output_ids"]


def test_a_row_that_cannot_be_sampled_fails_alone() -> None:
    """Non-finite logits in one row (what a validated request can still meet at step time): that row
    reports its error, the other rows get exactly the tokens a batch without it samples."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen)
    params = SamplingBatch(
        temperature=torch.tensor([0.0, 0.0, 0.0]),
        top_p=torch.ones(3),
        top_k=torch.full((3,), -1),
        generators=[None, None, None],
    )
    clean_ids, clean_lps, clean_errors = sample_rows(logits, params, torch.Generator().manual_seed(1))
    assert clean_errors == [None, None, None]
    poisoned = logits.clone()
    poisoned[1] = float("nan")
    hot = SamplingBatch(
        temperature=torch.tensor([0.0, 1.0, 0.0]),  # the NaN row samples: multinomial throws on it
        top_p=params.top_p,
        top_k=params.top_k,
        generators=params.generators,
    )
    ids, lps, errors = sample_rows(poisoned, hot, torch.Generator().manual_seed(1))
    assert errors[0] is None and errors[2] is None and errors[1] is not None
    assert [ids[0], ids[2]] == [clean_ids[0], clean_ids[2]]
    assert [lps[0], lps[2]] == [clean_lps[0], clean_lps[2]]
