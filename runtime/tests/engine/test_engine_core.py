"""The engine in process: the static-shape decode path (what CUDA graphs replay) equals eager decoding,
and a step that raises aborts its requests with the error instead of leaving them waiting."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch
from lockstep.engine import ReferenceEngine
from lockstep.serving import SamplingParams

PROMPTS = [[2, *range(10, 10 + n), 3] for n in (5, 17, 40, 3, 9)]


async def _generate(engine: ReferenceEngine, prompts: list[list[int]], sp: SamplingParams) -> list[Any]:
    seqs = [engine.new_sequence(p, sp) for p in prompts]
    return list(await asyncio.wait_for(asyncio.gather(*(engine.submit(s) for s in seqs)), 60))


async def test_static_bucketed_decode_equals_eager(tiny_dir: Path) -> None:
    greedy = SamplingParams(max_new_tokens=70, temperature=0.0, ignore_eos=True)  # kv crosses 64 -> 128
    outs = []
    for graphs in (False, True):
        engine = ReferenceEngine.load(
            tiny_dir, max_running_requests=6, context_length=256, cuda_graphs=graphs
        )
        await engine.start()
        outs.append(await _generate(engine, PROMPTS, greedy))
        used = sorted(engine.runner._graphs)
        await engine.close()
    eager, static = outs
    assert [s.output_ids for s in static] == [s.output_ids for s in eager]
    for a, b in zip(static, eager, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
    assert (6, 64) in used and (6, 128) in used  # 5 rows padded to the capped bucket; both kv buckets


async def test_failed_step_aborts_requests_and_engine_recovers(tiny_dir: Path) -> None:
    engine = ReferenceEngine.load(tiny_dir, max_running_requests=4, context_length=64)
    await engine.start()
    cache = engine.runner.k_cache
    engine.runner.k_cache = cache[:, :0]  # a real fault: no KV slots to write into
    failed = await _generate(engine, PROMPTS[:2], SamplingParams(max_new_tokens=4))
    assert [s.finish["type"] for s in failed] == ["abort", "abort"]
    assert "engine step failed" in failed[0].finish["message"] and engine.stats.failed_steps >= 1
    engine.runner.k_cache = cache
    ok = await _generate(engine, PROMPTS[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert [len(s.output_ids) for s in ok] == [4, 4]
    assert torch.equal(engine.runner.k_cache, cache)
    await engine.close()
