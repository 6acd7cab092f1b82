"""GLM-4.7: role openers without closers, <think> reasoning and XML-style key/value tool calls.

Format (from the GLM-4.5/4.6/4.7 documented chat template):
  [gMASK]<sop>                                               once, at the start of a conversation
  <|system|>\\n{content}   <|user|>\\n{content}
  <|assistant|><think>{reasoning}</think>{content}<tool_call>{name}<arg_key>{k}</arg_key><arg_value>{v}</arg_value></tool_call>
  <|observation|><tool_response>{result}</tool_response>     consecutive results share one opener
  generation prompt: <|assistant|>
Argument values that are strings are written raw; other values as JSON. A turn has no closing token:
the next message's opener ends it, and the model stops by sampling <|user|> or <|observation|>
(or <|endoftext|>).

TITO seam: that stop token is also the next message's opener, so the boundary would appear twice;
merge drops the trailing stop token of the stored row (at most 1 token) and lets the appended
message's own opener be the boundary.

Who calls it: lockstep.models.registry (registered as "glm47"); lockstep.models.families.glm5 (the
same renderer with GLM-5's GlmStyle).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from lockstep.models.families._bpe import BpeCodec
from lockstep.models.families._parse import split_calls
from lockstep.models.registry import Merge, Message, ModelFamily, ParsedReply, Tool, ToolCall, register

TFamily = TypeVar("TFamily", bound="Glm47")

SPECIALS = (
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
)
_STOPS = ("<|user|>", "<|observation|>", "<|endoftext|>")

_THINK = re.compile(r"^\s*<think>(.*?)</think>", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class GlmStyle:
    """What differs between the GLM templates that share this renderer (GLM-4.7 here, GLM-5 in glm5.py)."""

    name: str
    """The family's registered name (named in errors)."""
    role_separator: str
    """Between a system/user role token and its content: "\n" for GLM-4.7, nothing for GLM-5."""
    strip_content: bool
    """Assistant content is stripped when rendered (GLM-5's template does it)."""
    generation_prompt: str
    """What opens the model's turn: `<|assistant|>`, or `<|assistant|><think>` for GLM-5."""


GLM47_STYLE = GlmStyle(
    name="glm47", role_separator="\n", strip_content=False, generation_prompt="<|assistant|>"
)


class Glm47(ModelFamily):
    """The GLM-4.7 family (GLM-4.5/4.6 share the structure)."""

    style: ClassVar[GlmStyle] = GLM47_STYLE
    """The template's details (GLM-5 overrides them)."""

    def render(
        self, messages: Sequence[Message], add_generation_prompt: bool, tools: Sequence[Tool] = ()
    ) -> str:
        # Tool schemas are not rendered by this family's template here: describe tools in the prompt.
        return "[gMASK]<sop>" + render_turns(messages, add_generation_prompt, "", self.style)

    def render_appended(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return render_turns(messages, add_generation_prompt, "assistant", self.style)

    def merge(self, row_tail: Sequence[int], suffix: Sequence[int]) -> Merge:
        if row_tail and row_tail[-1] in self.stop_ids:  # the IDs of _STOPS (see build)
            return Merge(trim=1, bridge=(), suffix=tuple(suffix))
        return Merge(trim=0, bridge=(), suffix=tuple(suffix))

    def parse_reply(self, text: str) -> ParsedReply:
        for stop in _STOPS:
            text = text.removesuffix(stop)
        reasoning = ""
        m = _THINK.match(text)
        if m:
            reasoning, text = m.group(1), text[m.end() :]
        content, calls = split_calls(text, _TOOL_CALL, _parse_call)
        return ParsedReply(content=content.strip(), reasoning=reasoning.strip(), tool_calls=calls)


def _parse_call(body: str) -> ToolCall | None:
    """`name<arg_key>k</arg_key><arg_value>v</arg_value>...`; None (left as text) without a name."""
    name = re.split(r"<arg_key>", body, maxsplit=1)[0].strip()
    if not name:
        return None
    args = {k.strip(): _arg_value(v) for k, v in _ARG.findall(body)}
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def _arg_value(raw: str) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _arg_text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _assistant(m: Message, style: GlmStyle) -> str:
    content = m.content.strip() if style.strip_content else m.content
    out = f"<|assistant|><think>{m.reasoning}</think>{content}"
    for call in m.tool_calls:
        obj = call.arguments_obj()
        pairs = obj.items() if isinstance(obj, dict) else ()
        args = "".join(f"<arg_key>{k}</arg_key><arg_value>{_arg_text(v)}</arg_value>" for k, v in pairs)
        out += f"<tool_call>{call.name}{args}</tool_call>"
    return out


def render_turns(
    messages: Sequence[Message], add_generation_prompt: bool, previous_role: str, style: GlmStyle
) -> str:
    """The messages in GLM's format after a message of `previous_role` ("" at the start)."""
    parts: list[str] = []
    prev = previous_role
    for i, m in enumerate(messages):
        if m.role == "tool":
            opener = "<|observation|>" if prev != "tool" else ""
            parts.append(f"{opener}<tool_response>{m.content}</tool_response>")
        elif m.role == "assistant":
            parts.append(_assistant(m, style))
        elif m.role in ("system", "user"):
            parts.append(f"<|{m.role}|>{style.role_separator}{m.content}")
        else:
            raise ValueError(
                f"messages[{i}].role={m.role!r}: {style.name} renders system, user, assistant, tool"
            )
        prev = m.role
    if add_generation_prompt:
        parts.append(style.generation_prompt)
    return "".join(parts)


def build(tokenizer_dir: str | None = None) -> Glm47:
    """Build the GLM-4.7 family with the model's tokenizer.json from `tokenizer_dir`, or the offline stand-in."""
    return build_glm(Glm47, tokenizer_dir)


def build_glm(cls: type[TFamily], tokenizer_dir: str | None = None) -> TFamily:
    """A GLM family (`cls`, named by its style) with the model's tokenizer.json or the offline stand-in."""
    codec = BpeCodec.load(tokenizer_dir, SPECIALS)
    ids = codec.special_to_id
    return cls(
        name=cls.style.name,
        codec=codec,
        special_ids=frozenset(ids.values()),
        stop_ids=frozenset(ids[s] for s in _STOPS),
        role_openers={
            ids["<|system|>"]: "system",
            ids["<|user|>"]: "user",
            ids["<|assistant|>"]: "assistant",
            ids["<|observation|>"]: "tool",
        },
    )


register("glm47", build)
