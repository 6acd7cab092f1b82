"""The family modules against the real chat templates: what a family renders is what the checkpoint's
own Jinja template renders (transformers' apply_chat_template), wherever the template is append-only;
and the session server speaks the checkpoint's tokenizer.

The families keep only what a template cannot say (the TITO seam, reply parsing); these tests fail
when a family's render drifts from the template it stands for.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from lockstep.models import ChatTokenizer
from lockstep.models.families import get_family
from lockstep.models.registry import Message, ToolCall
from lockstep.models.tiny import chat_tokenizer
from lockstep.rollout.session.server import SessionServer, SessionServerConfig

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "evaluate an arithmetic expression",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
CALL = ToolCall("calc", '{"expression": "12 * 7"}')
PROMPT = [Message("system", "You are a calculator."), Message("user", "What is 12 * 7?")]
# One query, then an agent's turns after it (the part of a conversation TITO keeps appending to).
AGENT = [
    Message("user", "What is 12 * 7?"),
    Message("assistant", "", reasoning="multiply", tool_calls=(CALL,)),
    Message("tool", "84"),
    Message("assistant", "The answer is 84.", reasoning="done"),
]


def hf_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Family messages as the OpenAI/HF dicts a chat template reads."""
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.reasoning:
            d["reasoning_content"] = m.reasoning
        if m.tool_calls:
            d["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                for c in m.tool_calls
            ]
        out.append(d)
    return out


@pytest.mark.parametrize(("fixture", "family"), [("qwen3", "qwen3"), ("glm5", "glm5")])
@pytest.mark.parametrize(
    ("messages", "gen", "tools"),
    [(PROMPT, True, None), (PROMPT, True, TOOLS), (AGENT, False, None), (AGENT[:3], True, None)],
    ids=["prompt", "prompt-tools", "agent-turns", "agent-next-turn"],
)
def test_the_family_renders_what_the_checkpoint_template_renders(
    fixture: str,
    family: str,
    messages: list[Message],
    gen: bool,
    tools: list[dict[str, Any]] | None,
    hf_checkpoint: Callable[[str], Path],
) -> None:
    d = hf_checkpoint(fixture)
    fam = get_family(family, str(d))
    template = ChatTokenizer.load(d)
    assert fam.render(messages, gen, tools or ()) == template.render_text(hf_messages(messages), gen, tools)
    assert fam.encode_messages(messages, gen, tools or ()) == template.render(
        hf_messages(messages), gen, tools
    )


def test_qwen3_keeps_reasoning_the_stock_template_drops(hf_checkpoint: Callable[[str], Path]) -> None:
    """The one documented difference: Qwen3's template drops the reasoning of turns before the last
    query (not append-only); the family keeps it where it was sampled."""
    d = hf_checkpoint("qwen3")
    history = [*AGENT, Message("user", "And 2 + 3?")]
    family_text = get_family("qwen3", str(d)).render(history, True)
    template_text = ChatTokenizer.load(d).render_text(hf_messages(history), True)
    assert "<think>\nmultiply\n</think>" in family_text and "multiply" not in template_text


def test_tiny_family_renders_the_tiny_template() -> None:
    tool_turns = [
        Message("user", "calc 1+2"),
        Message("assistant", "", tool_calls=(CALL,)),
        Message("tool", "3"),
    ]
    fam, template = get_family("tiny"), chat_tokenizer()
    for messages, gen in ((tool_turns, True), ([Message("system", "s"), *tool_turns[:1]], True)):
        hf = [{**m, "tool_calls": [{"function": {"name": "calc", "arguments": CALL.arguments}}]} if m.get("tool_calls") else m for m in hf_messages(messages)]  # fmt: skip
        assert fam.render(messages, gen) == template.render_text(hf, gen)


@pytest.mark.parametrize(("fixture", "family"), [("qwen3", "qwen3"), ("glm5", "glm5")])
def test_the_session_server_uses_the_checkpoints_tokenizer(
    fixture: str, family: str, hf_checkpoint: Callable[[str], Path]
) -> None:
    d = hf_checkpoint(fixture)
    server = SessionServer(SessionServerConfig(family=family, tokenizer_dir=str(d)), engine=None)  # type: ignore[arg-type]
    assert getattr(server.family.codec, "source", "") == str(d / "tokenizer.json")
    text = ChatTokenizer.load(d).render_text(hf_messages(PROMPT), True)
    assert server.family.codec.encode(text) == ChatTokenizer.load(d).encode(text)
    # The family stops where the checkpoint's generation_config.json says a turn ends.
    assert server.family.stop_ids == set(ChatTokenizer.load(d).stop_token_ids)
