"""The model-family registry: chat template, tokenizer, boundary merge and reply parser per family.

Why it exists: TITO (§3) is a per-model contract. The session server never re-tokenizes what
the model sampled; it keeps the sampled token IDs and only tokenizes the messages an agent appends
(tool results, user turns) plus the next assistant opener. Where the stored row and that freshly
tokenized suffix meet, each family has its own seam: Qwen3's template writes "\\n" after <|im_end|>
but the model stops at <|im_end|>; GLM-4.7's stop tokens <|user|>/<|observation|> are also the next
message's opener. A family module states these facts once: how to render a conversation, how to
render only appended messages, how to repair the seam (`merge`), and how to parse a reply into
content, reasoning and tool calls.

Who calls it: lockstep.rollout.session (the session server and its pure logic), the tool-calling toy
task (lockstep.tasks.toolcalc) and tests. Families register themselves here; the lookup by name
(`get_family`) is lockstep.models.families, which imports every built-in family first.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

Tool = Mapping[str, Any]
"""An OpenAI tool schema ({"type": "function", "function": {"name", "description", "parameters"}})."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call the assistant made, as OpenAI's chat API carries it."""

    name: str
    """Function name, e.g. "calc"."""
    arguments: str
    """The arguments as a JSON object string, exactly as the model wrote it (never re-serialized)."""
    id: str = ""
    """Call id the server hands to the agent (wire-only: no template renders it)."""

    def arguments_obj(self) -> object:
        """The arguments parsed as JSON, or the raw string when they are not valid JSON."""
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message in the family-neutral form every template renders."""

    role: str
    """system | user | assistant | tool."""
    content: str = ""
    """Visible text (empty for a tool-call-only assistant turn)."""
    reasoning: str = ""
    """Assistant reasoning text (inside <think>…</think> for families that have it)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Assistant tool calls, in the order the model emitted them."""
    tool_call_id: str = ""
    """For role=tool: the id of the call this result answers (wire-only)."""


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """What a sampled assistant reply means to the agent."""

    content: str
    """Visible text with reasoning and tool-call markup removed."""
    reasoning: str
    """Reasoning text, empty when the reply had none."""
    tool_calls: tuple[ToolCall, ...]
    """Tool calls found in the reply (ids not yet assigned)."""


@dataclass(frozen=True, slots=True)
class Merge:
    """How to join a stored token row and a freshly tokenized suffix (pure result of a family's merge).

    The joined row is `row[: len(row) - trim] + bridge + suffix`.
    """

    trim: int
    """Tokens dropped from the end of the stored row (at most 1, GLM-4.7's overlapping stop token)."""
    bridge: tuple[int, ...]
    """Tokens the template has at the seam but the model never sampled (Qwen3's "\\n")."""
    suffix: tuple[int, ...]
    """The tokens of the appended messages and the next assistant opener, possibly shortened."""


class Codec(Protocol):
    """The tokenizer surface the session server needs."""

    def encode(self, text: str) -> list[int]:
        """Token IDs of `text`; special-token strings in the text become their single IDs."""
        ...

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`; with skip_special, the family's special tokens are left out."""
        ...


@dataclass(slots=True)
class ModelFamily:
    """A model family: the one place that knows its chat format and its TITO seam.

    Subclasses (one module per family in lockstep.models.families) implement the render and parse
    methods; `merge` is pure and golden-tested.
    """

    name: str
    """Registry key, e.g. "qwen3"."""
    codec: Codec
    """Tokenizer built offline in code (special tokens map to single IDs)."""
    special_ids: frozenset[int] = field(default_factory=frozenset)
    """IDs of every control token (role markers, stop tokens, think and tool-call markers)."""
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    """Tokens that end an assistant turn (sent to the engine as stop_token_ids)."""
    role_openers: dict[int, str] = field(default_factory=dict)
    """Control token -> role it opens; "" means the role is the first line of the text after it."""

    def render(
        self, messages: Sequence[Message], add_generation_prompt: bool, tools: Sequence[Tool] = ()
    ) -> str:
        """The canonical text of a whole conversation (what a chat template would produce).

        `tools` are OpenAI tool schemas; families whose template declares tools render them at the
        start of the conversation (the others ignore them, documented per family).
        """
        raise NotImplementedError

    def render_appended(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        """Text of non-assistant messages appended after an assistant turn, plus the opener.

        It starts exactly where the canonical render continues after the assistant turn's
        closing (which the merge supplies), so `merge(row, encode(render_appended(...)))` equals
        the canonical tokens of the seam.
        """
        raise NotImplementedError

    def merge(self, row_tail: Sequence[int], suffix: Sequence[int]) -> Merge:
        """Repair the seam between a stored row (its last tokens) and a new suffix."""
        raise NotImplementedError

    def parse_reply(self, text: str) -> ParsedReply:
        """Split a decoded reply (control tokens kept) into content, reasoning and tool calls."""
        raise NotImplementedError

    def encode_messages(
        self, messages: Sequence[Message], add_generation_prompt: bool, tools: Sequence[Tool] = ()
    ) -> list[int]:
        """Token IDs of the canonical render (first turn of a session, and the mismatch check)."""
        return self.codec.encode(self.render(messages, add_generation_prompt, tools))


FamilyFactory = Callable[[str | None], ModelFamily]
"""Builds a family; the argument is the model's checkpoint dir holding its tokenizer, or None."""
FACTORIES: dict[str, FamilyFactory] = {}
"""Registered family factories by name (lockstep.models.families looks them up)."""


def register(name: str, factory: FamilyFactory) -> None:
    """Register a family factory under `name` (family modules call this at import)."""
    FACTORIES[name] = factory
