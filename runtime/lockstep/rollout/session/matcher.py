"""Message matchers: does a message an agent replays describe the stored one (§3)?

Why it exists: an agent replays the whole history every turn. The server reuses a stored token
checkpoint only when every replayed message up to it matches the stored message at that position.
Replayed assistant text only locates a checkpoint; it never rebuilds sampled tokens. How strict the
comparison is decides which harness drift is tolerated:

- strict (default): role, content, reasoning and tool calls (name and the exact arguments string;
  wire-only keys such as the call id are ignored). Tolerated: a replay that drops the reasoning
  (many harnesses never send it back; the sampled reasoning stays in the stored tokens) and
  whitespace around assistant content (a harness that strips or adds a trailing newline).
- loose_tool_call: as strict, but tool-call arguments match when they are equal as JSON, so key
  order and whitespace of the re-serialized arguments do not matter.
- role_content_only: compares role and content only. Risky: a tool-call turn usually has empty
  visible text, so two turns that called different tools look identical; the stored prefix wins and
  the trained history then contains a call the agent never made on this path. Use it only for
  harnesses that cannot replay tool calls at all.

Who calls it: lockstep.rollout.session.tree (locating the deepest usable checkpoint).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from lockstep.models.registry import Message, ToolCall

Matcher = Callable[[Message, Message], bool]
"""(stored, replayed) -> True when the replayed message may reuse the stored one's tokens."""


def _content_equal(stored: Message, replayed: Message) -> bool:
    if stored.role == "assistant":
        # Harnesses strip or add surrounding whitespace of replies; the tokens come from the
        # checkpoint anyway, and whitespace alone never distinguishes two execution paths.
        return stored.content.strip() == replayed.content.strip()
    return stored.content == replayed.content


def _reasoning_equal(stored: Message, replayed: Message) -> bool:
    # A dropped reasoning (empty replay) is accepted; a different non-empty one is not.
    return not replayed.reasoning or stored.reasoning.strip() == replayed.reasoning.strip()


def _json_equal(a: str, b: str) -> bool:
    try:
        return bool(json.loads(a or "{}") == json.loads(b or "{}"))
    except ValueError:
        return a == b


def _calls_equal(a: tuple[ToolCall, ...], b: tuple[ToolCall, ...], loose: bool) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.name != y.name:
            return False
        same = _json_equal(x.arguments, y.arguments) if loose else x.arguments == y.arguments
        if not same:
            return False
    return True


def _full_match(stored: Message, replayed: Message, loose: bool) -> bool:
    return (
        stored.role == replayed.role
        and _content_equal(stored, replayed)
        and _reasoning_equal(stored, replayed)
        and _calls_equal(stored.tool_calls, replayed.tool_calls, loose=loose)
    )


def strict(stored: Message, replayed: Message) -> bool:
    """Role, content, reasoning and exact tool calls (ids ignored)."""
    return _full_match(stored, replayed, loose=False)


def loose_tool_call(stored: Message, replayed: Message) -> bool:
    """As strict, but tool-call arguments compare as parsed JSON (key order, whitespace ignored)."""
    return _full_match(stored, replayed, loose=True)


def role_content_only(stored: Message, replayed: Message) -> bool:
    """Role and content only: tool calls ignored (risky, see the module docstring)."""
    return stored.role == replayed.role and _content_equal(stored, replayed)


MATCHERS: dict[str, Matcher] = {
    "strict": strict,
    "loose_tool_call": loose_tool_call,
    "role_content_only": role_content_only,
}
"""Matcher name -> function; the session's `matcher` option picks one."""


def get_matcher(name: str) -> Matcher:
    """The matcher called `name`; a clear error lists the choices."""
    try:
        return MATCHERS[name]
    except KeyError:
        raise ValueError(f"matcher={name!r} is unknown; choose one of {', '.join(MATCHERS)}") from None


def explain_mismatch(stored: Message, replayed: Message) -> str:
    """The first field on which `replayed` differs from `stored` under strict (for error messages)."""
    if stored.role != replayed.role:
        return f"role {replayed.role!r} != stored {stored.role!r}"
    if not _content_equal(stored, replayed):
        return "content differs"
    if not _reasoning_equal(stored, replayed):
        return "reasoning differs"
    if not _calls_equal(stored.tool_calls, replayed.tool_calls, loose=True):
        return "tool_calls differ (name, count or arguments)"
    if not _calls_equal(stored.tool_calls, replayed.tool_calls, loose=False):
        return "tool_calls arguments differ in JSON serialization (key order or whitespace)"
    return "no difference"
