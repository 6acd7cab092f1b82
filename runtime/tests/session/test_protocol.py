"""The request fast path converts exactly like the pydantic schema, and defers to it otherwise."""

from __future__ import annotations

from typing import Any

from lockstep.rollout.session.protocol import ChatRequest, fast_messages

WELL_FORMED: list[dict[str, Any]] = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u", "name": "me"},
    {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": [],
        "audio": None,
        "function_call": None,
        "reasoning_content": "r",
        "tool_calls": [
            {"id": "c1", "type": "function", "index": 0, "function": {"name": "calc", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {"role": "assistant", "content": "done", "tool_calls": []},
]


def test_fast_path_equals_the_schema_conversion() -> None:
    fast = fast_messages(WELL_FORMED)
    slow = [m.to_message() for m in ChatRequest.model_validate({"messages": WELL_FORMED}).messages]
    assert fast == slow


def test_unusual_messages_take_the_schema_path() -> None:
    for odd in (
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},  # valid, but text parts
        {"role": "user", "content": "x", "token_ids": [1]},  # invalid: the schema names the field
        {"role": "robot", "content": "x"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
    ):
        assert fast_messages([odd]) is None
