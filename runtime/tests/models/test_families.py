"""Append-only chat-template tests and merge goldens for every registered family (CPU, §3).

A family is TITO-safe when (1) rendering a longer history only appends after a shorter history's
tokens, and (2) the row the model actually samples, joined by the family's merge with the tokens of
the appended messages, equals the canonical render of the longer history.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from lockstep.models.families import get_family, names
from lockstep.models.registry import Message, ToolCall
from lockstep.models.tiny import chat_tokenizer, save_tokenizer

CONVERSATION = [
    Message("system", "You are a calculator agent."),
    Message("user", "What is 12 * 7?"),
    Message(
        "assistant", "", reasoning="multiply", tool_calls=(ToolCall("calc", '{"expression": "12 * 7"}'),)
    ),
    Message("tool", "84"),
    Message("assistant", "The answer is 84.", reasoning="done"),
    Message("user", "And 2 + 3?"),
    Message(
        "assistant",
        "",
        tool_calls=(ToolCall("calc", '{"expression": "2 + 3"}'), ToolCall("calc", '{"expression": "3 + 2"}')),
    ),
    Message("tool", "5"),
    Message("tool", "5"),
    Message("assistant", "5"),
]
ASSISTANT_AT = [i for i, m in enumerate(CONVERSATION) if m.role == "assistant"]


def sampled_row(family_name: str, canonical: list[int], next_role: str) -> list[int]:
    """What the model samples for the history: the canonical tokens, ending the way the model stops."""
    fam = get_family(family_name)
    if family_name == "qwen3":
        assert fam.codec.decode(canonical[-2:]) == "<|im_end|>\n"
        return canonical[:-1]  # the model stops at <|im_end|>; it never samples the "\n"
    if family_name in ("glm47", "glm5"):
        stop = "<|observation|>" if next_role == "tool" else "<|user|>"
        return canonical + fam.codec.encode(stop)  # the stop token is also the next opener
    return canonical  # tiny: the assistant turn ends with the sampled <|eos|>


def test_registry_lists_the_families() -> None:
    assert {"qwen3", "glm47", "glm5", "tiny"} <= set(names())
    with pytest.raises(KeyError, match="registered families"):
        get_family("llama")


@pytest.mark.parametrize("name", ["qwen3", "glm47", "glm5", "tiny"])
def test_render_is_append_only(name: str) -> None:
    fam = get_family(name)
    full = fam.encode_messages(CONVERSATION, add_generation_prompt=False)
    for k in ASSISTANT_AT:
        shorter = fam.encode_messages(CONVERSATION[: k + 1], add_generation_prompt=False)
        assert full[: len(shorter)] == shorter, f"{name}: rendering after message {k} rewrote earlier tokens"


@pytest.mark.parametrize("name", ["qwen3", "glm47", "glm5", "tiny"])
def test_sampled_row_plus_merged_suffix_equals_canonical(name: str) -> None:
    fam = get_family(name)
    for a, b in itertools.pairwise(ASSISTANT_AT):
        canonical = fam.encode_messages(CONVERSATION[: a + 1], add_generation_prompt=False)
        row = sampled_row(name, canonical, CONVERSATION[a + 1].role)
        suffix = fam.codec.encode(fam.render_appended(CONVERSATION[a + 1 : b], add_generation_prompt=True))
        m = fam.merge(row[-4:], suffix)
        joined = row[: len(row) - m.trim] + list(m.bridge) + list(m.suffix)
        assert joined == fam.encode_messages(CONVERSATION[:b], add_generation_prompt=True)


def test_qwen3_merge_appends_the_newline_after_im_end() -> None:
    fam = get_family("qwen3")
    im_end, nl = fam.codec.encode("<|im_end|>")[0], fam.codec.encode("\n")
    m = fam.merge([300, im_end], [301])
    assert (m.trim, m.bridge, m.suffix) == (0, tuple(nl), (301,))
    # The engine trimmed the stop token: close the turn as the template does.
    assert fam.merge([300, 302], [301]).bridge == (im_end, *nl)


def test_glm47_merge_trims_at_most_one_overlapping_stop_token() -> None:
    fam = get_family("glm47")
    obs, user = fam.codec.encode("<|observation|>")[0], fam.codec.encode("<|user|>")[0]
    assert fam.merge([300, obs], [obs, 301]).trim == 1
    assert fam.merge([obs, user], [user, 301]).trim == 1  # only the last token, never two
    assert fam.merge([300, 302], [obs, 301]).trim == 0


def test_tiny_merge_needs_no_repair_after_eos() -> None:
    fam = get_family("tiny")
    assert fam.merge([7, 1], [4, 9]).bridge == ()
    assert fam.merge([7, 8], [4, 9]).bridge == (1,)


@pytest.mark.parametrize("name", ["qwen3", "glm47", "glm5", "tiny"])
def test_parse_reply_round_trips_a_rendered_assistant_turn(name: str) -> None:
    fam = get_family(name)
    turn = CONVERSATION[6]
    text = fam.render([turn], add_generation_prompt=False)
    body = text.split("assistant\n", 1)[1] if name == "qwen3" else text.split("<|assistant|>", 1)[1]
    parsed = fam.parse_reply(body)
    assert [c.name for c in parsed.tool_calls] == ["calc", "calc"]
    assert [c.arguments_obj() for c in parsed.tool_calls] == [
        {"expression": "2 + 3"},
        {"expression": "3 + 2"},
    ]
    assert parsed.content == ""


def test_qwen3_keeps_the_models_own_argument_bytes() -> None:
    fam = get_family("qwen3")
    raw = '<tool_call>\n{"name": "calc", "arguments": {"b":1,  "a": 2}}\n</tool_call><|im_end|>'
    (call,) = fam.parse_reply(raw).tool_calls
    assert call.arguments == '{"b":1,  "a": 2}'


@pytest.mark.parametrize(
    ("name", "bad", "good", "end"),
    [
        (
            "tiny",
            '<call>{"name": calc}</call>',
            '<call>{"name":"calc","arguments":{"a":1}}</call>',
            "<|eos|>",
        ),
        (
            "qwen3",
            '<tool_call>\n{"name": calc}\n</tool_call>',
            '\n<tool_call>\n{"name": "calc", "arguments": {"a":1}}\n</tool_call>',
            "<|im_end|>",
        ),
        (
            "glm47",
            "<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
            "<tool_call>calc<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
            "<|user|>",
        ),
        (
            "glm5",
            "<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
            "<tool_call>calc<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
            "<|observation|>",
        ),
    ],
)
def test_malformed_tool_call_stays_visible_text(name: str, bad: str, good: str, end: str) -> None:
    fam = get_family(name)
    parsed = fam.parse_reply(f"{bad}hi{good}{end}")
    assert [(c.name, c.arguments_obj()) for c in parsed.tool_calls] == [("calc", {"a": 1})]
    assert parsed.content == f"{bad}hi"


def test_qwen3_tools_block_keeps_the_template_append_only() -> None:
    fam = get_family("qwen3")
    tools = [{"type": "function", "function": {"name": "calc", "description": "add", "parameters": {}}}]
    full = fam.encode_messages(CONVERSATION, add_generation_prompt=False, tools=tools)
    for k in ASSISTANT_AT:
        shorter = fam.encode_messages(CONVERSATION[: k + 1], add_generation_prompt=False, tools=tools)
        assert full[: len(shorter)] == shorter
    text = fam.render(CONVERSATION[:2], add_generation_prompt=True, tools=tools)
    assert text.startswith("<|im_start|>system\nYou are a calculator agent.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1


def test_a_real_tokenizer_json_is_loaded_and_checked(tmp_path: Path) -> None:
    stand_in = get_family("qwen3")
    qwen_dir, glm_dir = tmp_path / "qwen", tmp_path / "glm"
    qwen_dir.mkdir()
    glm_dir.mkdir()
    stand_in.codec.tokenizer.save(str(qwen_dir / "tokenizer.json"))  # type: ignore[attr-defined]
    get_family("glm47").codec.tokenizer.save(str(glm_dir / "tokenizer.json"))  # type: ignore[attr-defined]
    loaded = get_family("qwen3", str(qwen_dir))
    text = stand_in.render(CONVERSATION, add_generation_prompt=True)
    assert loaded.codec.encode(text) == stand_in.codec.encode(text)
    with pytest.raises(ValueError, match="<\\|im_start\\|>"):
        get_family("qwen3", str(glm_dir))  # a GLM vocabulary has no ChatML tokens
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        get_family("glm47", str(tmp_path / "missing"))


def test_tiny_reads_a_checkpoint_vocabulary(tmp_path: Path) -> None:
    save_tokenizer(tmp_path)
    assert get_family("tiny", str(tmp_path)).codec.encode("<|user|>hi") == [2, *chat_tokenizer().encode("hi")]
