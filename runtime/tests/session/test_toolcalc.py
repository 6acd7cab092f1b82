"""The toolcalc environment and its agent: a whole episode through the in-process session server."""

from __future__ import annotations

import pytest
from lockstep.models.tiny import chat_tokenizer
from lockstep.rollout.plugins import AgentContext, check_generate, check_reward, load_function
from lockstep.rollout.session.local import toolcalc_agent
from lockstep.serving import EngineClient, SamplingParams
from lockstep.tasks.base import TaskItem
from lockstep.tasks.toolcalc import ToolCalc, calc, reward, score
from lockstep.types import Sample


def test_calc_is_a_safe_integer_evaluator() -> None:
    assert calc({"expression": "12*7-4"}) == "80"
    assert calc({"expression": "__import__('os')"}).startswith("error")
    assert calc({"expression": "2**99"}).startswith("error")
    assert calc({}).startswith("error")


def test_items_are_deterministic_and_answers_correct() -> None:
    task = ToolCalc(seed=3)
    a, b = task.item(5), ToolCalc(seed=3).item(5)
    assert a == b
    assert a.answer == calc({"expression": a.metadata["expression"]})
    assert task.item(5, "eval") != a
    chat_tokenizer().encode(a.messages[0]["content"])  # every prompt is in the tiny vocabulary


def test_score_rewards_the_tool_path() -> None:
    assert score(True, True, " 5", "5") == 1.0
    assert score(False, False, "5", "5") == 0.0  # answering without the tool earns nothing
    assert score(True, True, "6", "5") == 0.2


def test_plugins_load_through_the_manifest_contract() -> None:
    check_generate(
        load_function("lockstep.rollout.session.local:toolcalc_agent", "spec.agent.agentFunction"), "x"
    )
    check_reward(load_function("lockstep.tasks.toolcalc:reward", "spec.agent.rewardFunction"), "x")


async def test_episode_yields_the_token_exact_sample_and_full_reward(
    engine_url: str, conversations: tuple[str, ...]
) -> None:
    tok = chat_tokenizer()
    item = TaskItem(0, ({"role": "user", "content": "calc 2+3"},), "5", {"expression": "2+3"})
    async with EngineClient(engine_url) as client:
        ctx = AgentContext(
            client=client,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=64),
            decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
            encode=tok.encode,
        )
        sample = Sample(group_index=0, index=0, prompt_ids=[], metadata={"item": item, "answer": "5"})
        sample = await toolcalc_agent(ctx, sample)
    sample.check()
    assert tok.decode(sample.prompt_ids + sample.response_ids) == conversations[2]
    assert sample.metadata["toolcalc"] == {"called_calc": True, "well_formed": True, "final": "5"}
    assert reward(sample, "") == pytest.approx(1.0)
    assert sample.metadata["tito_mismatch"] == []
