"""Small parsing helpers shared by the family modules (pure, no tokenizer).

Why it exists: every family's parse_reply does the same two steps with its own markup: take the
tool calls out of the reply text (a malformed call stays visible text, so the agent sees what the
model wrote) and parse each call. Qwen3 and tiny write a call as a JSON object whose "arguments"
value is itself JSON; we keep the arguments exactly as the model wrote them (the agent sees the
model's own bytes), so we locate the raw span of that value instead of re-serializing it.

Who calls it: lockstep.models.families.qwen3, glm47 and tiny.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from lockstep.models.registry import ToolCall

_DECODER = json.JSONDecoder()


def raw_json_field(obj_text: str, key: str) -> str | None:
    """The raw text of `key`'s value in a JSON object string, or None when absent or malformed.

    Only top-level keys are found: the object is walked with raw_decode so nested objects that
    happen to contain the same key are skipped.
    """
    text = obj_text.strip()
    if not text.startswith("{"):
        return None
    i = 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "}":
            return None
        try:
            name, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return None
        while i < n and text[i] in " \t\r\n":
            i += 1
        if i >= n or text[i] != ":":
            return None
        i += 1
        while i < n and text[i] in " \t\r\n":
            i += 1
        try:
            _, end = _DECODER.raw_decode(text, i)
        except ValueError:
            return None
        if name == key:
            return text[i:end]
        i = end
    return None


def split_calls(
    text: str, pattern: re.Pattern[str], parse: Callable[[str], ToolCall | None]
) -> tuple[str, tuple[ToolCall, ...]]:
    """(text without the calls, the calls) for every `pattern` match whose group 1 `parse` accepts.

    A match `parse` rejects (None) is left in the text: the agent sees the malformed call as written.
    """
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in pattern.finditer(text):
        call = parse(m.group(1))
        if call is None:
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    return "".join(kept), tuple(calls)


def parse_json_call(body: str) -> ToolCall | None:
    """A {"name": ..., "arguments": {...}} call with its raw arguments text; None when malformed."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    raw = raw_json_field(body, "arguments")
    return ToolCall(name=obj["name"], arguments=raw if raw is not None else "{}")
