"""CUDA checks of the reference engine: captured decode graphs give what eager decoding gives, and the
returned logprobs equal an independent HF forward of the same tokens (fp32 on the GPU)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from lockstep.engine import ReferenceEngine
from lockstep.serving import SamplingParams
from transformers import Qwen3ForCausalLM


async def _generate(engine: ReferenceEngine, prompts: list[list[int]], sp: SamplingParams) -> list[Any]:
    await engine.start()
    try:
        return list(
            await asyncio.wait_for(
                asyncio.gather(*(engine.submit(engine.new_sequence(p, sp)) for p in prompts)), 120
            )
        )
    finally:
        await engine.close()


@pytest.mark.gpu
def test_cuda_graphs_match_eager_and_hf_forward(tiny_dir: Path) -> None:
    prompts = [[2, *range(10, 10 + n), 3] for n in (5, 17, 40, 3)]
    greedy = SamplingParams(max_new_tokens=70, temperature=0.0, ignore_eos=True)  # crosses a kv bucket
    runs = []
    for graphs in (False, True):
        engine = ReferenceEngine.load(
            tiny_dir,
            device="cuda",
            dtype=torch.float32,
            max_running_requests=4,
            context_length=256,
            cuda_graphs=graphs,
        )
        assert engine.runner.cuda_graphs == graphs
        runs.append(asyncio.run(_generate(engine, prompts, greedy)))
    eager, graphed = runs
    assert [s.output_ids for s in graphed] == [s.output_ids for s in eager]
    model: Any = Qwen3ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    model = model.to("cuda")
    model.eval()
    for s in graphed:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([s.tokens], device="cuda")).logits[0].float(), dim=-1)
        ref = [logp[s.prompt_len - 1 + j, t].item() for j, t in enumerate(s.output_ids)]
        assert s.logprobs == pytest.approx(ref, abs=1e-4)
