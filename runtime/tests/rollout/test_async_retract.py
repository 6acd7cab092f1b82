"""A weight update during fully-async rollout, on the real reference engine over HTTP.

The worker keeps trajectories in flight; the update pauses the engine with mode retract, loads other
weights as version 1 and continues. The retracted requests are not lost: they finish under the new
weights, so each trajectory spans two versions and its per-token versions prove it; the buffer then
measures the group as S_old 1, S_post 0, delta_gen 1.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from lockstep.driver.engines import EngineServer, start_reference_engine
from lockstep.models import resolve_checkpoint
from lockstep.rollout.async_worker import AsyncRolloutWorker, Prompt
from lockstep.rollout.buffer import GroupBuffer
from lockstep.rollout.generate import single_turn
from lockstep.rollout.plugins import RolloutContext
from lockstep.serving.client import EngineClient
from lockstep.serving.payloads import SamplingParams
from lockstep.types import Sample

NEW_TOKENS = 120
"""Long enough that no trajectory can finish before the update lands."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """builtin:tiny (materialized once per pytest session, shared with test_async_driver) and a copy
    with perturbed weights: what the update switches to."""
    import torch
    from safetensors.torch import load_file, save_file

    a = resolve_checkpoint("builtin:tiny", cache_dir=tmp_path_factory.getbasetemp() / "lockstep-cache")
    b = tmp_path_factory.mktemp("v1")
    for f in a.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, b / f.name)
    gen = torch.Generator().manual_seed(1)
    tensors = load_file(str(a / "model.safetensors"))
    noisy = {k: t + 0.05 * torch.randn(t.shape, generator=gen).to(t.dtype) for k, t in tensors.items()}
    save_file(noisy, str(b / "model.safetensors"), metadata={"format": "pt"})
    return a, b


@pytest.fixture
async def engine(checkpoints: tuple[Path, Path]) -> AsyncIterator[EngineServer]:
    server = await asyncio.to_thread(start_reference_engine, checkpoints[0])
    try:
        yield server
    finally:
        await asyncio.to_thread(server.stop)


def two_prompts() -> Iterator[Prompt]:
    yield Prompt([3, 4, 5])
    yield Prompt([6, 7, 8])


async def test_retracted_trajectories_continue_under_new_weights(
    engine: EngineServer, checkpoints: tuple[Path, Path]
) -> None:
    async with EngineClient(engine.url) as client:
        ctx = RolloutContext(
            client=client,
            sampling=SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=1.0),
            decode=lambda ids: "",
            encode=lambda text: [],
        )

        async def generate(sample: Sample) -> Sample:
            return await single_turn(ctx, sample)

        buffer = GroupBuffer(capacity=4)
        worker = AsyncRolloutWorker(generate, two_prompts(), buffer, samples_per_prompt=2, max_in_flight=4)
        worker.start()
        while engine.engine.stats.generated_tokens < 8:  # every trajectory is under way
            await asyncio.sleep(0.005)
        await client.pause_generation("retract")
        await client.update_weights_from_disk(str(checkpoints[1]), weight_version=1)
        await client.continue_generation()
        await buffer.set_version(1)
        got = [await buffer.get(), await buffer.get()]
        await worker.stop()

    assert worker.counters.finished_samples == 4
    for consumed in got:
        st = consumed.staleness
        assert (st.s_old, st.s_post, st.delta_gen) == (1, 0, 1)
        assert st.coverage == 1.0 and st.mixed
        for s in consumed.group.samples:
            assert len(s.response_ids) == NEW_TOKENS
            v = [x for x in s.token_versions if x is not None]
            assert len(v) == NEW_TOKENS  # every token carries its version
            assert v[0] == 0 and v[-1] == 1  # one trajectory, two versions
            assert v == sorted(v)  # versions only move forward inside a trajectory
