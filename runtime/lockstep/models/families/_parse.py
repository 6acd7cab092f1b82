"""Small parsing helpers shared by the family modules (pure, no tokenizer).

Why it exists: Qwen3 writes a tool call as a JSON object whose "arguments" value is itself JSON;
we keep the arguments exactly as the model wrote them (the agent sees the model's own bytes), so we
locate the raw span of that value instead of re-serializing it.

Who calls it: lockstep.models.families.qwen3 (and any future JSON-tool-call family).
"""

from __future__ import annotations

import json

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
