"""GLM-5 (transformers' GlmMoeDsaForCausalLM): GLM's role tokens, an opened <think> and XML tool calls.

Format (GLM-5's chat template; the tests check this module against it, and that template byte for byte
against SGLang's own Python port of GLM-5.3's):
  [gMASK]<sop><|system|>Reasoning Effort: Max       once, at the start (then the tools block, if any)
  <|system|>{content}   <|user|>{content}          no newline after a role token
  <|assistant|><think>{reasoning}</think>{content}<tool_call>{name}<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>
  <|observation|><tool_response>{result}</tool_response>     consecutive results share one opener
  generation prompt: <|assistant|><think>   (the model samples its reasoning, then </think>)
Assistant content is stripped; reasoning is rendered where it was sampled (the template keeps it
unless clear_thinking is passed), so rendering is append-only.

What the template cannot say, and this module does: the TITO seam (the model stops on <|user|>,
<|observation|> or <|endoftext|>, and the first two are also the next message's opener: merge
drops that one trailing stop token, as for GLM-4.7) and parsing a reply that starts inside the
<think> the prompt opened.

Who calls it: lockstep.models.registry (registered as "glm5").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import ClassVar

from lockstep.models.families._parse import split_calls
from lockstep.models.families.glm47 import (
    _STOPS,
    _TOOL_CALL,
    Glm47,
    GlmStyle,
    _parse_call,
    build_glm,
    render_turns,
)
from lockstep.models.registry import Message, ParsedReply, Tool, register

GLM5_STYLE = GlmStyle(
    name="glm5", role_separator="", strip_content=True, generation_prompt="<|assistant|><think>"
)
"""No newline after a role token, stripped assistant content, a generation prompt that opens <think>."""

_TOOLS_HEAD = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_TOOLS_TAIL = (
    "</tools>\n\nFor each function call, output the function name and arguments within the following XML "
    "format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
    "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
)


class Glm5(Glm47):
    """The GLM-5 family (GLM-5.x text models): GLM-4.7's renderer with GLM-5's style."""

    style: ClassVar[GlmStyle] = GLM5_STYLE

    def render(
        self, messages: Sequence[Message], add_generation_prompt: bool, tools: Sequence[Tool] = ()
    ) -> str:
        head = "[gMASK]<sop><|system|>Reasoning Effort: Max"
        if tools:
            schemas = "".join(json.dumps(t.get("function", t), ensure_ascii=False) + "\n" for t in tools)
            head += _TOOLS_HEAD + schemas + _TOOLS_TAIL
        return head + render_turns(messages, add_generation_prompt, "", self.style)

    def parse_reply(self, text: str) -> ParsedReply:
        for stop in _STOPS:
            text = text.removesuffix(stop)
        reasoning = ""
        if "</think>" in text:  # the prompt opened <think>: the reply starts inside it
            reasoning, text = text.split("</think>", 1)
            reasoning = reasoning.removeprefix("<think>")
        content, calls = split_calls(text, _TOOL_CALL, _parse_call)
        return ParsedReply(content=content.strip(), reasoning=reasoning.strip(), tool_calls=calls)


def build(tokenizer_dir: str | None = None) -> Glm5:
    """Build the GLM-5 family with the model's tokenizer.json from `tokenizer_dir`, or the offline stand-in."""
    return build_glm(Glm5, tokenizer_dir)


register("glm5", build)
