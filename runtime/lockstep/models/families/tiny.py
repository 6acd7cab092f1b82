"""The tiny family: what the tiny chat template cannot say (the TITO seam, tool-call parsing).

Format (lockstep.models.tiny's chat template, checked against it in the tests): [<|system|>text]
<|user|>text <|assistant|>text<|eos|> <|tool|>text, generation prompt <|assistant|>. The tiny tokenizer has no tool-call tokens, so a tool call is
written in the assistant text as <call>{"name": ..., "arguments": {...}}</call> (every character is
in the tiny vocabulary). The tiny format has no reasoning block; reasoning is not rendered.

TITO seam: none to repair when the engine returns the sampled <|eos|>: the template closes an
assistant turn with exactly that token. When the row does not end with <|eos|> (the engine trimmed
it), merge supplies it.

Who calls it: lockstep.models.registry (registered as "tiny"), the session server for `builtin:tiny`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from lockstep.models import tiny
from lockstep.models.families._bpe import BpeCodec
from lockstep.models.families._parse import parse_json_call, split_calls
from lockstep.models.registry import Merge, Message, ModelFamily, ParsedReply, Tool, ToolCall, register

_CALL = re.compile(r"<call>(.*?)</call>", re.DOTALL)


class Tiny(ModelFamily):
    """The tiny family of `lockstep run` and the CPU tests."""

    def render(
        self, messages: Sequence[Message], add_generation_prompt: bool, tools: Sequence[Tool] = ()
    ) -> str:
        # Tool schemas are not rendered by this family's template here: describe tools in the prompt.
        return _render(messages, add_generation_prompt)

    def render_appended(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return _render(messages, add_generation_prompt)

    def merge(self, row_tail: Sequence[int], suffix: Sequence[int]) -> Merge:
        eos = next(iter(self.stop_ids))  # the one stop token, <|eos|>
        if row_tail and row_tail[-1] == eos:
            return Merge(trim=0, bridge=(), suffix=tuple(suffix))
        return Merge(trim=0, bridge=(eos,), suffix=tuple(suffix))

    def parse_reply(self, text: str) -> ParsedReply:
        text = text.removesuffix("<|eos|>")
        content, calls = split_calls(text, _CALL, parse_json_call)
        return ParsedReply(content=content, reasoning="", tool_calls=calls)


def render_call(call: ToolCall) -> str:
    """The tiny text of one tool call (what the model must write to call a tool)."""
    args = call.arguments if call.arguments.strip() else "{}"
    return f'<call>{{"name":{json.dumps(call.name)},"arguments":{args}}}</call>'


def _render(messages: Sequence[Message], add_generation_prompt: bool) -> str:
    parts: list[str] = []
    for i, m in enumerate(messages):
        if m.role == "assistant":
            calls = "".join(render_call(c) for c in m.tool_calls)
            parts.append(f"<|assistant|>{m.content}{calls}<|eos|>")
        elif m.role in ("system", "user", "tool"):
            parts.append(f"<|{m.role}|>{m.content}")
        else:
            raise ValueError(f"messages[{i}].role={m.role!r}: tiny renders system, user, assistant, tool")
    if add_generation_prompt:
        parts.append("<|assistant|>")
    return "".join(parts)


def build(tokenizer_dir: str | None = None) -> Tiny:
    """Build the tiny family with the checkpoint's tokenizer.json from `tokenizer_dir`, or the tiny
    tokenizer built in code (the same vocabulary) when None."""
    specials = tiny.SPECIAL_TOKENS
    if tokenizer_dir:
        codec = BpeCodec.from_dir(tokenizer_dir, specials)
    else:
        codec = BpeCodec(tiny.tiny_tokenizer(), specials, "builtin:tiny")
    ids = codec.special_to_id
    return Tiny(
        name="tiny",
        codec=codec,
        special_ids=frozenset(ids.values()),
        stop_ids=frozenset({ids["<|eos|>"]}),
        role_openers={
            ids["<|system|>"]: "system",
            ids["<|user|>"]: "user",
            ids["<|assistant|>"]: "assistant",
            ids["<|tool|>"]: "tool",
        },
    )


register("tiny", build)
