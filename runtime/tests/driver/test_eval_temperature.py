"""Evaluation samples at schedule.evalTemperature for agents too (lockstep.driver.steps.evaluate).

An agent samples through its own context (AgentContext.sampling: the terminal agent passes it to its
sessions), so the evaluation must set the eval temperature there as well as on the plain rollout
context; otherwise an agentic job's greedy eval is a sample at the rollout temperature.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

from lockstep.driver.steps import evaluate
from lockstep.rollout.generate import Rollout
from lockstep.rollout.plugins import AgentContext, Plugins, RolloutContext
from lockstep.serving.payloads import SamplingParams
from lockstep.tasks.registry import load_task
from lockstep.types import Sample


def _components(seen: list[tuple[str, float]]) -> Any:
    async def generate(ctx: RolloutContext, sample: Sample) -> Sample:
        seen.append(("generate", ctx.sampling.temperature))
        sample.response_ids, sample.loss_mask, sample.rollout_logprobs = [1], [1], [0.0]
        sample.token_versions = [0]
        return sample

    async def agent(ctx: AgentContext, sample: Sample) -> Sample:
        seen.append(("agent", ctx.sampling.temperature))
        assert ctx.generate is not None
        return await ctx.generate(sample)  # a custom agent's model turn

    sampling = SamplingParams(max_new_tokens=4, temperature=1.8)
    ctx = RolloutContext(
        client=cast(Any, None), sampling=sampling, decode=lambda ids: "", encode=lambda t: []
    )
    agent_ctx = AgentContext(ctx.client, sampling, ctx.decode, ctx.encode)
    agent_ctx.generate = lambda s: generate(ctx, s)
    plugins = Plugins(generate=generate, reward=lambda sample, text: 0.0, agent=agent)
    rollout = Rollout(ctx=ctx, plugins=plugins, render=lambda msgs: [0], agent_ctx=agent_ctx)
    task = load_task("builtin:reverse", "builtin:reverse", 0)
    return SimpleNamespace(
        rollout=rollout,
        settings=SimpleNamespace(eval_temperature=0.0),
        task=task,
        item_metadata=lambda item: {"answer": item.answer},
    )


def test_agent_evaluates_at_the_eval_temperature() -> None:
    seen: list[tuple[str, float]] = []
    c = _components(seen)
    asyncio.run(evaluate(c))
    assert seen and {kind for kind, _ in seen} == {"agent", "generate"}
    assert {t for _, t in seen} == {0.0}, seen
    # the run's own contexts keep the rollout temperature for training
    assert c.rollout.ctx.sampling.temperature == 1.8
    assert c.rollout.agent_ctx.sampling.temperature == 1.8
    seen.clear()
    asyncio.run(c.rollout.run_sample(Sample(0, 0, [0], metadata={})))
    assert {t for _, t in seen} == {1.8}
