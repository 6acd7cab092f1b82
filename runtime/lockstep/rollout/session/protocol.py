"""Wire models of the session server: what agents send and what they get back.

Why it exists: the session server speaks OpenAI's chat-completions shape (so the real `openai`
client works with base_url=.../sessions/{id}/v1) plus three session endpoints. Requests are parsed
with extra="forbid": an unknown field is a 400 naming it, and fields that would let an agent supply
token IDs or offsets are refused with an explicit reason (the server owns the token row, §3).
Capture options (logprobs, meta info, routing data) are accepted and ignored: the server sets
them itself for every request.

Who calls it: lockstep.rollout.session.server.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lockstep.models.registry import Message, ToolCall

FORBIDDEN_FIELDS = frozenset(
    {
        "input_ids",
        "prompt_token_ids",
        "prompt_ids",
        "token_ids",
        "output_ids",
        "completion_token_ids",
        "offsets",
        "token_offsets",
        "prompt_offsets",
        "prefix_offset",
        "checkpoint",
        "checkpoint_id",
    }
)
"""Fields that would let an agent supply or point into token IDs: always a 400."""

CAPTURE_FIELDS = frozenset(
    {
        "logprobs",
        "top_logprobs",
        "return_logprob",
        "return_meta_info",
        "return_routed_experts",
        "no_stop_trim",
    }
)
"""Capture options the server sets itself; a request may carry them, their values are ignored."""


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateSession(_Wire):
    """POST /sessions body (all optional: an unset field takes the server's default, which in a job is
    spec.rollout.session)."""

    mode: Literal["linear", "branching"] | None = None
    """linear: one trajectory, one assistant-turn rollback; branching: append-only tree, one per leaf."""
    matcher: Literal["strict", "loose_tool_call", "role_content_only"] | None = None
    """How replayed messages are compared with stored ones (see lockstep.rollout.session.matcher)."""
    max_nodes: int | None = Field(default=None, ge=1, le=65536)
    """Cap on stored turns of a branching session."""


class SamplesRequest(_Wire):
    """POST /sessions/{id}/samples body (optional)."""

    check_mismatch: bool = True
    """Run the tito_session_mismatch diagnostic on each trajectory (re-tokenizes the conversation)."""


class WireFunction(_Wire):
    """The function of a tool call."""

    name: str
    """Function name."""
    arguments: str = "{}"
    """Arguments as a JSON object string."""


class WireToolCall(_Wire):
    """One tool call as the OpenAI API carries it."""

    id: str = ""
    """Call id (wire-only)."""
    type: Literal["function"] = "function"
    """Always "function"."""
    function: WireFunction
    """The call."""
    index: int | None = None
    """Streaming index (wire-only, ignored)."""


class TextPart(_Wire):
    """A text content part (images and audio are not supported on the session path)."""

    type: Literal["text"]
    """Always "text"."""
    text: str
    """The text."""


class WireMessage(_Wire):
    """One chat message an agent sends."""

    role: Literal["system", "user", "assistant", "tool"]
    """Who wrote it."""
    content: str | list[TextPart] | None = None
    """Text, or text parts (joined)."""
    reasoning_content: str | None = None
    """Assistant reasoning as this server returned it (may be dropped by the agent)."""
    tool_calls: list[WireToolCall] | None = None
    """Assistant tool calls."""
    tool_call_id: str | None = None
    """For role=tool: the call this result answers."""
    name: str | None = None
    """Optional author name (not rendered)."""
    refusal: str | None = None
    """Echoed by some clients; not rendered."""
    annotations: list[Any] | None = None
    """Echoed by OpenAI clients that replay response messages; not rendered."""
    audio: Any = None
    """Echoed by OpenAI clients; must be empty (audio is not supported on the session path)."""
    function_call: Any = None
    """Legacy OpenAI field, echoed as null by clients; not rendered."""

    def to_message(self) -> Message:
        content = self.content
        text = "".join(p.text for p in content) if isinstance(content, list) else (content or "")
        calls = tuple(ToolCall(c.function.name, c.function.arguments, c.id) for c in self.tool_calls or ())
        return Message(
            role=self.role,
            content=text,
            reasoning=self.reasoning_content or "",
            tool_calls=calls,
            tool_call_id=self.tool_call_id or "",
        )


class ChatOptions(_Wire):
    """POST /sessions/{id}/v1/chat/completions body without its messages (the OpenAI fields honoured)."""

    model: str | None = None
    """Ignored: the session's engine decides."""
    tools: list[dict[str, Any]] | None = None
    """Tool schemas; rendered into the first prompt by families that declare tools (qwen3), and
    fixed for the life of the session."""
    tool_choice: Any = None
    """Accepted, not enforced (the model decides)."""
    parallel_tool_calls: bool | None = None
    """Accepted, not enforced."""
    max_tokens: int | None = Field(default=None, ge=1, le=2**31)
    """Token budget of the reply."""
    max_completion_tokens: int | None = Field(default=None, ge=1, le=2**31)
    """Token budget of the reply (newer name; wins over max_tokens)."""
    temperature: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    """Sampling temperature."""
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    """Nucleus sampling."""
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    """Sampling seed (passed to the engine as sampling_seed)."""
    stop: str | list[str] | None = Field(default=None, max_length=64)
    """Extra stop strings."""
    n: int = Field(default=1, ge=1, le=1)
    """Only 1: a session turn has one reply (use a branching session for several)."""
    stream: Literal[False] = False
    """Streaming is not supported."""
    user: str | None = None
    """Ignored."""
    metadata: dict[str, Any] | None = None
    """Ignored (the server records its own meta info)."""
    logprobs: bool | None = None
    """The server always captures logprobs for training; true also returns them to the agent."""
    top_logprobs: int | None = None
    """Ignored."""
    return_logprob: bool | None = None
    """Ignored (SGLang name of the capture option)."""
    return_meta_info: bool | None = None
    """Ignored."""
    return_routed_experts: bool | None = None
    """Ignored: routing capture follows the server's R3 setting."""
    no_stop_trim: bool | None = None
    """Ignored."""


class ChatRequest(ChatOptions):
    """POST /sessions/{id}/v1/chat/completions body: the schema every request is held to."""

    messages: list[WireMessage]
    """The whole conversation so far (the server matches it against its checkpoints)."""


_MESSAGE_KEYS = frozenset(WireMessage.model_fields)
_CALL_KEYS = frozenset(WireToolCall.model_fields)
_FUNCTION_KEYS = frozenset(WireFunction.model_fields)
_ROLES = frozenset({"system", "user", "assistant", "tool"})


def _fast_call(c: object) -> ToolCall | None:
    if type(c) is not dict or not _CALL_KEYS.issuperset(c) or c.get("type", "function") != "function":
        return None
    cid, idx, fn = c.get("id", ""), c.get("index"), c.get("function")
    if type(cid) is not str or (idx is not None and type(idx) is not int):
        return None
    if type(fn) is not dict or not _FUNCTION_KEYS.issuperset(fn):
        return None
    name, args = fn.get("name"), fn.get("arguments", "{}")
    if type(name) is not str or type(args) is not str:
        return None
    return ToolCall(name, args, cid)


def _fast_message(m: object) -> Message | None:
    if type(m) is not dict or not _MESSAGE_KEYS.issuperset(m) or m.get("role") not in _ROLES:
        return None
    content, reasoning = m.get("content") or "", m.get("reasoning_content") or ""
    if type(content) is not str or type(reasoning) is not str:
        return None  # text parts, or anything unusual: the pydantic path decides
    if any(m.get(k) is not None and type(m.get(k)) is not str for k in ("tool_call_id", "name", "refusal")):
        return None
    if m.get("audio") is not None or m.get("function_call") is not None:
        return None
    if m.get("annotations") is not None and type(m.get("annotations")) is not list:
        return None
    raw_calls = m.get("tool_calls")
    if raw_calls is not None and type(raw_calls) is not list:
        return None
    calls = tuple(_fast_call(c) for c in raw_calls or ())
    if any(c is None for c in calls):
        return None
    return Message(m["role"], content, reasoning, calls, m.get("tool_call_id") or "")  # type: ignore[arg-type]


def fast_messages(items: list[Any]) -> list[Message] | None:
    """Messages of a well-formed request without building pydantic models (the 64K-token hot path).

    Accepts a strict subset of what ChatRequest accepts and converts exactly as
    WireMessage.to_message does; anything else returns None and the pydantic path validates (and
    names the bad field).
    """
    out: list[Message] = []
    for m in items:
        msg = _fast_message(m)
        if msg is None:
            return None
        out.append(msg)
    return out


def forbidden_fields(body: object) -> list[str]:
    """Paths of token-ID or offset fields anywhere in the request (top level or inside messages)."""
    found: list[str] = []
    if not isinstance(body, dict):
        return found
    found += [k for k in body if k in FORBIDDEN_FIELDS]
    for i, m in enumerate(body.get("messages") or []):
        if isinstance(m, dict):
            found += [f"messages[{i}].{k}" for k in m if k in FORBIDDEN_FIELDS]
    return found


def describe(err: ValidationError) -> str:
    """A one-line description of a pydantic error naming each field."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        parts.append(f"{loc}: {e['msg']}")
    return "; ".join(parts)
