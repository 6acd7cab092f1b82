"""The engine in process: the static-shape decode path (what CUDA graphs replay) equals eager decoding,
and a step that raises aborts its requests with the error instead of leaving them waiting."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lockstep.engine import ReferenceEngine
from lockstep.engine.runner import SamplingBatch, _truncate, sample
from lockstep.serving import EngineClient, SamplingParams

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


async def test_paused_context_holds_steps_and_retracts(tiny_dir: Path) -> None:
    """The in-process API the weights helper uses: nothing steps inside paused(); retracted work resumes."""
    engine = ReferenceEngine.load(tiny_dir, max_running_requests=4, context_length=256)
    await engine.start()
    seq = engine.new_sequence(PROMPTS[0], SamplingParams(max_new_tokens=150, ignore_eos=True))
    task = asyncio.create_task(engine.submit(seq))
    while len(seq.output_ids) < 3:
        await asyncio.sleep(0.001)
    async with engine.paused(mode="retract"):
        held = len(seq.output_ids)
        steps = engine.stats.steps
        await asyncio.sleep(0.05)  # give a (wrongly) running scheduler the chance to step
        assert engine.stats.steps == steps and len(seq.output_ids) == held and engine.is_paused
        engine.load_weights([(n, t * 0.5) for n, t in engine.named_weights().items()])
        engine.set_weight_version(1)
    done = await asyncio.wait_for(task, 60)
    assert (
        len(done.output_ids) == 150
        and done.versions[:held] == [0] * held
        and set(done.versions[held:]) == {1}
    )
    await engine.close()


def test_cli_serves_the_engine(tiny_dir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "lockstep", "engine", "--model", str(tiny_dir), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    async def talk() -> list[int]:
        async with EngineClient(f"http://127.0.0.1:{port}") as client:
            await client.wait_ready(timeout_s=120)
            res = await client.generate(
                [2, 16, 3], SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
            )
            out: list[int] = res.output_ids
            return out

    try:
        assert len(asyncio.run(talk())) == 5
    finally:
        proc.terminate()
        proc.wait(30)


def test_sampling_policy_golden() -> None:
    """Pure sampling policy: greedy takes the argmax; top-k 1 and a tiny top-p leave only the argmax;
    the logprob is log_softmax(logits / T) of the untruncated distribution."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.1, 0.2, 2.5], [4.0, 1.0, 0.0, 0.0]])
    params = SamplingBatch(
        temperature=torch.tensor([0.0, 0.5, 2.0]),
        top_p=torch.tensor([1.0, 1.0, 1e-6]),
        top_k=torch.tensor([-1, 1, -1]),
        generators=[None, None, torch.Generator().manual_seed(0)],
    )
    ids, lps = sample(logits, params, torch.Generator().manual_seed(0))
    assert ids == [1, 3, 0]
    expect = [
        torch.log_softmax(logits[0], -1)[1],
        torch.log_softmax(logits[1] / 0.5, -1)[3],
        torch.log_softmax(logits[2] / 2.0, -1)[0],
    ]
    assert lps == [pytest.approx(float(e), abs=1e-6) for e in expect]
    kept = _truncate(torch.softmax(logits, -1), torch.tensor([2, -1, -1]), torch.tensor([1.0, 0.8, 1.0]))
    assert (kept > 0).tolist() == [
        [False, True, True, False],  # top-2
        [True, False, False, True],  # the top token holds 0.75 < 0.8, the next one completes the nucleus
        [True, True, True, True],
    ]


def test_receive_targets_are_the_live_storage_or_staging(tiny_dir: Path) -> None:
    engine = ReferenceEngine.load(tiny_dir, max_running_requests=2, context_length=64)
    live = engine.named_weights()
    names = sorted(live)
    specs = [(n, live[n].dtype, tuple(live[n].shape)) for n in names]
    specs[0] = (names[0], torch.bfloat16, tuple(live[names[0]].shape))
    targets = engine.receive_targets(specs)
    assert targets[0] is None  # dtype differs: received into staging, then cast-copied
    # Everything else is received straight into the parameter's own storage (no allocation, no copy).
    assert all(
        t is not None and t.data_ptr() == live[n].data_ptr()
        for n, t in zip(names[1:], targets[1:], strict=True)
    )
    with pytest.raises(KeyError, match=r"'model\.nope\.weight' is not a parameter"):
        engine.receive_targets([*specs, ("model.nope.weight", torch.float32, (2,))])
    with pytest.raises(ValueError, match=re.escape(f"{names[1]} has shape (3,)")):
        engine.receive_targets([(names[1], torch.float32, (3,))])
