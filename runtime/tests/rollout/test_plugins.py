"""Contract tests of the extension points (lockstep.rollout.plugins): one per point, plus loading errors.

Each contract test runs a manifest-style import path through the real loader and the real runner
(`Rollout.run_sample`) against a real reference engine on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from lockstep.driver.engines import EngineServer, PoolClient, start_reference_engine
from lockstep.models import ChatTokenizer, resolve_checkpoint
from lockstep.rollout.generate import Rollout, single_turn
from lockstep.rollout.plugins import AgentContext, PluginError, RolloutContext, load_plugins
from lockstep.serving.client import EngineClient
from lockstep.serving.payloads import SamplingParams
from lockstep.types import Sample, SampleStatus

USER_CODE = '''
from lockstep.types import SampleStatus

async def gen_fixed(ctx, sample):
    """A generate function: asks the engine, keeps only the first token (a custom turn)."""
    result = await ctx.client.generate(sample.prompt_ids, ctx.sampling, return_logprob=True)
    sample.response_ids = result.output_ids[:1]
    sample.loss_mask = [1]
    sample.rollout_logprobs = result.output_logprobs[:1]
    sample.token_versions = result.token_versions[:1]
    return sample

def reward_len(sample, response):
    return float(len(sample.response_ids))

async def reward_async(sample, response):
    return 0.25

async def agent_two_turns(ctx, sample):
    """An agent: one model turn, an environment token (loss mask 0), another model turn."""
    sample = await ctx.generate(sample)
    first = list(sample.response_ids)
    env = ctx.encode("=")
    turn2 = await ctx.client.generate(sample.prompt_ids + first + env, ctx.sampling, return_logprob=True)
    sample.response_ids = first + env + turn2.output_ids
    sample.loss_mask = sample.loss_mask + [0] * len(env) + [1] * len(turn2.output_ids)
    sample.rollout_logprobs = sample.rollout_logprobs + [0.0] * len(env) + turn2.output_logprobs
    sample.token_versions = sample.token_versions + [None] * len(env) + turn2.token_versions
    sample.metadata["turns"] = ctx.max_turns
    sample.metadata["env_at"] = len(first)
    return sample

def not_async(ctx, sample):
    return sample

async def wrong_arity(sample):
    return sample

def boom(sample, response):
    raise RuntimeError("reward backend down")

def returns_text(sample, response):
    return "1.0"

VALUE = 3
'''


@pytest.fixture(scope="module")
def user_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("usercode")
    (root / "lockstep_user_plugins.py").write_text(textwrap.dedent(USER_CODE))
    sys.path.insert(0, str(root))
    yield "lockstep_user_plugins"
    sys.path.remove(str(root))
    sys.modules.pop("lockstep_user_plugins", None)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineServer, Path]]:
    model = resolve_checkpoint("builtin:tiny", cache_dir=tmp_path_factory.mktemp("cache"))
    server = start_reference_engine(model)
    yield server, model
    server.stop()


def _default_reward(sample: Sample, response: str) -> float:
    return 1.0 if response else 0.0


async def _run(
    engine: tuple[EngineServer, Path], plugins_kw: dict[str, str], max_turns: int | None = None
) -> Sample:
    server, model = engine
    tok = ChatTokenizer.load(model)
    async with EngineClient(server.url) as client:
        ctx = RolloutContext(
            client=PoolClient([client]),
            sampling=SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=[tok.eos_token_id]),
            decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
            encode=tok.encode,
        )
        plugins = load_plugins(single_turn, _default_reward, **plugins_kw)
        agent_ctx = None
        if plugins.agent is not None:
            agent_ctx = AgentContext(ctx.client, ctx.sampling, ctx.decode, ctx.encode, max_turns=max_turns)
            agent_ctx.generate = lambda s: plugins.generate(ctx, s)
        rollout = Rollout(ctx, plugins, lambda m: tok.render(m, add_generation_prompt=True), agent_ctx)
        prompt = rollout.render([{"role": "user", "content": "rev 123"}])
        return await rollout.run_sample(Sample(group_index=0, index=0, prompt_ids=prompt))


def test_default_generate_and_reward(engine: tuple[EngineServer, Path]) -> None:
    s = asyncio.run(_run(engine, {}))
    assert 1 <= len(s.response_ids) <= 4
    assert s.loss_mask == [1] * len(s.response_ids)
    assert all(lp <= 0 for lp in s.rollout_logprobs) and s.token_versions == [0] * len(s.response_ids)
    assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
    assert s.reward in (0.0, 1.0)


def test_generate_function_contract(engine: tuple[EngineServer, Path], user_module: str) -> None:
    s = asyncio.run(
        _run(
            engine, {"generate_path": f"{user_module}:gen_fixed", "reward_path": f"{user_module}:reward_len"}
        )
    )
    assert len(s.response_ids) == 1 and s.reward == 1.0


def test_reward_function_contract_sync_and_async(engine: tuple[EngineServer, Path], user_module: str) -> None:
    s = asyncio.run(_run(engine, {"reward_path": f"{user_module}:reward_async"}))
    assert s.reward == 0.25


def test_agent_function_contract(engine: tuple[EngineServer, Path], user_module: str) -> None:
    s = asyncio.run(_run(engine, {"agent_path": f"{user_module}:agent_two_turns"}, max_turns=2))
    s.check()
    eq = s.metadata["env_at"]
    assert s.response_ids[eq] == ChatTokenizer.load(engine[1]).encode("=")[0]
    assert s.loss_mask[eq] == 0 and s.token_versions[eq] is None  # the environment token never trains
    assert s.metadata["turns"] == 2


def test_user_errors_mark_the_sample_failed(engine: tuple[EngineServer, Path], user_module: str) -> None:
    s = asyncio.run(_run(engine, {"reward_path": f"{user_module}:boom"}))
    assert s.status is SampleStatus.FAILED and "reward backend down" in s.metadata["error"]
    s = asyncio.run(_run(engine, {"reward_path": f"{user_module}:returns_text"}))
    assert s.status is SampleStatus.FAILED and "must return a float" in s.metadata["error"]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"generate_path": "no_such_pkg.mod:fn"},
            r"spec.agent.generateFunction: cannot import module 'no_such_pkg.mod'",
        ),
        (
            {"reward_path": "{m}:missing"},
            r"spec.agent.rewardFunction: module '{m}' has no attribute 'missing'",
        ),
        ({"reward_path": "{m}:VALUE"}, r"spec.agent.rewardFunction: '{m}:VALUE' is a int, not a function"),
        (
            {"generate_path": "{m}:not_async"},
            r"spec.agent.generateFunction: .*must be async def f\(ctx, sample\)",
        ),
        ({"agent_path": "{m}:wrong_arity"}, r"spec.agent.agentFunction: wrong_arity must have the signature"),
        ({"reward_path": "{m}"}, r"spec.agent.rewardFunction: '{m}' is not an import path"),
    ],
)
def test_loading_errors_name_the_manifest_field(user_module: str, kw: dict[str, str], message: str) -> None:
    kw = {k: v.format(m=user_module) for k, v in kw.items()}
    with pytest.raises(PluginError, match=message.format(m=user_module)):
        load_plugins(single_turn, _default_reward, **kw)
