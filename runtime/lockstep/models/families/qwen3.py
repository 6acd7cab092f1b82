"""Qwen3: ChatML turns, <think> reasoning and <tool_call> JSON tool calls.

Format (from Qwen3's documented chat template; with tools, the system turn carries a "# Tools"
block listing each schema as JSON inside <tools></tools>):
  <|im_start|>{role}\\n{content}<|im_end|>\\n            for system and user
  <|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n\\n{content}\\n<tool_call>\\n{json}\\n</tool_call><|im_end|>\\n
  <|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n   for tool results; consecutive
      results share one user turn, separated by "\\n"
  generation prompt: <|im_start|>assistant\\n
The tool call JSON is {"name": ..., "arguments": {...}}.

One deliberate difference: Qwen3's stock template drops the <think> block of assistant turns before
the last user message, so rendering a longer history rewrites tokens of a shorter one (not
append-only). Like Miles' fixed templates, we render reasoning where it was sampled.

TITO seam: the model stops at <|im_end|> and never samples the "\\n" the template writes after it;
merge appends that "\\n" (and the <|im_end|> too if the engine trimmed the stop token).

Who calls it: lockstep.models.registry (registered as "qwen3").
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from lockstep.models.families._bpe import BpeCodec
from lockstep.models.families._parse import parse_json_call, split_calls
from lockstep.models.registry import Merge, Message, ModelFamily, ParsedReply, Tool, register

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
SPECIALS = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

_THINK = re.compile(r"^\s*<think>\n?(.*?)\n?</think>\s*", re.DOTALL)
_TOOL_CALL = re.compile(r"\n?<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class Qwen3(ModelFamily):
    """The Qwen3 family (dense and MoE share the template)."""

    def render(
        self, messages: Sequence[Message], add_generation_prompt: bool, tools: Sequence[Tool] = ()
    ) -> str:
        if not tools:
            return _render(messages, add_generation_prompt, previous_role="")
        system = messages[0].content if messages and messages[0].role == "system" else ""
        rest = messages[1:] if messages and messages[0].role == "system" else messages
        head = f"{IM_START}system\n{system + chr(10) * 2 if system else ''}{_tools_block(tools)}{IM_END}\n"
        return head + _render(rest, add_generation_prompt, previous_role="system")

    def render_appended(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        # The assistant turn before these messages is closed by "<|im_end|>\n", which the merge
        # supplies; so the appended text starts at the next <|im_start|>.
        return _render(messages, add_generation_prompt, previous_role="assistant")

    def merge(self, row_tail: Sequence[int], suffix: Sequence[int]) -> Merge:
        im_end = self.codec.encode(IM_END)[0]
        newline = tuple(self.codec.encode("\n"))
        if row_tail and row_tail[-1] == im_end:
            return Merge(trim=0, bridge=newline, suffix=tuple(suffix))
        # The engine trimmed the stop token (or the turn had none): close the turn as the template does.
        return Merge(trim=0, bridge=(im_end, *newline), suffix=tuple(suffix))

    def parse_reply(self, text: str) -> ParsedReply:
        text = text.rstrip().removesuffix(ENDOFTEXT).removesuffix(IM_END)
        reasoning = ""
        m = _THINK.match(text)
        if m:
            reasoning, text = m.group(1), text[m.end() :]
        content, calls = split_calls(text, _TOOL_CALL, parse_json_call)
        return ParsedReply(content=content.strip(), reasoning=reasoning.strip(), tool_calls=calls)


def _tools_block(tools: Sequence[Tool]) -> str:
    """The tool declaration Qwen3's template puts in the system turn."""
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        f"{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _assistant_body(m: Message) -> str:
    out = ""
    if m.reasoning:
        out += f"<think>\n{m.reasoning}\n</think>\n\n"
    out += m.content
    for i, call in enumerate(m.tool_calls):
        if m.content or i > 0:
            out += "\n"
        args = call.arguments if call.arguments.strip() else "{}"
        out += f'<tool_call>\n{{"name": {json.dumps(call.name)}, "arguments": {args}}}\n</tool_call>'
    return out


def _render(messages: Sequence[Message], add_generation_prompt: bool, previous_role: str) -> str:
    parts: list[str] = []
    prev = previous_role
    for i, m in enumerate(messages):
        if m.role == "tool":
            nxt = messages[i + 1].role if i + 1 < len(messages) else ""
            opening = f"{IM_START}user" if prev != "tool" else ""
            closing = f"{IM_END}\n" if nxt != "tool" else ""
            parts.append(f"{opening}\n<tool_response>\n{m.content}\n</tool_response>{closing}")
        elif m.role == "assistant":
            parts.append(f"{IM_START}assistant\n{_assistant_body(m)}{IM_END}\n")
        elif m.role in ("system", "user"):
            parts.append(f"{IM_START}{m.role}\n{m.content}{IM_END}\n")
        else:
            raise ValueError(f"messages[{i}].role={m.role!r}: qwen3 renders system, user, assistant, tool")
        prev = m.role
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


def build(tokenizer_dir: str | None = None) -> Qwen3:
    """Build the Qwen3 family with the model's tokenizer.json from `tokenizer_dir`, or the offline stand-in."""
    codec = BpeCodec.load(tokenizer_dir, SPECIALS)
    ids = codec.special_to_id
    return Qwen3(
        name="qwen3",
        codec=codec,
        special_ids=frozenset(ids.values()),
        stop_ids=frozenset({ids[IM_END], ids[ENDOFTEXT]}),
        role_openers={ids[IM_START]: ""},
    )


register("qwen3", build)
