"""Pure TITO session logic: checkpoints, matching under harness drift, linear and branching rules.

The engine is replaced by explicit token lists here (this module tests the pure logic; the server
tests drive the real engine). Every assertion compares token IDs, never text.
"""

from __future__ import annotations

import pytest
from lockstep.models.families import get_family
from lockstep.models.registry import Message, ModelFamily, ToolCall
from lockstep.rollout.session.matcher import get_matcher
from lockstep.rollout.session.mismatch import classify, closed_row
from lockstep.rollout.session.tree import SessionError, SessionMode, TokenTree, TurnOutput

TINY = get_family("tiny")
QWEN = get_family("qwen3")
GLM = get_family("glm47")


def tree(
    mode: str = "linear", matcher: str = "strict", family: ModelFamily = TINY, max_nodes: int = 256
) -> TokenTree:
    return TokenTree(family, SessionMode(mode), get_matcher(matcher), max_nodes)


def out(ids: list[int], finish: str = "stop", version: int = 3) -> TurnOutput:
    return TurnOutput(ids, [-0.5 - i * 0.01 for i in range(len(ids))], [version] * len(ids), finish)


def turn(
    t: TokenTree, msgs: list[Message], ids: list[int], finish: str = "stop"
) -> tuple[list[int], Message]:
    """Plan, 'sample' ids, commit; returns the prompt sent and the stored reply."""
    plan = t.plan(msgs)
    prompt = list(plan.input_ids)  # commit extends plan.input_ids into C_k in place
    parsed = t.family.parse_reply(t.family.codec.decode(ids))
    reply = Message("assistant", parsed.content, parsed.reasoning, parsed.tool_calls)
    t.commit(plan, reply, out(ids, finish))
    return prompt, reply


CALL = '<call>{"name":"calc","arguments":{"a": 2, "b": 3}}</call>'
USER = Message("user", "add 2 and 3")


def test_second_prompt_extends_the_first_checkpoint_exactly() -> None:
    t = tree()
    o1 = TINY.codec.encode(CALL + "<|eos|>")
    p1, r1 = turn(t, [USER], o1)
    assert r1.tool_calls[0].name == "calc"
    p2, _ = turn(t, [USER, r1, Message("tool", "5")], TINY.codec.encode("5<|eos|>"))
    assert p2[: len(p1) + len(o1)] == p1 + o1  # C_1 = P_1 || O_1 is reused verbatim
    assert p2[len(p1) + len(o1) :] == TINY.codec.encode("<|tool|>5<|assistant|>")
    (s,) = t.samples()
    assert s.prompt_ids == p1
    assert s.response_ids == o1 + TINY.codec.encode("<|tool|>5<|assistant|>") + TINY.codec.encode("5<|eos|>")
    assert s.loss_mask == [1] * len(o1) + [0] * 3 + [1] * 2
    assert s.token_versions[: len(o1)] == [3] * len(o1) and s.token_versions[len(o1)] is None


def test_sampled_ids_survive_even_when_text_would_tokenize_differently() -> None:
    t = tree(family=QWEN)
    # The model spelled " answer" character by character; the canonical BPE has one token for it.
    odd = [i for ch in " answer" for i in QWEN.codec.encode(ch)] + QWEN.codec.encode("<|im_end|>")
    assert QWEN.codec.encode(" answer") != odd[:-1]
    p1, r1 = turn(t, [Message("user", "hi")], odd)
    p2, _ = turn(t, [Message("user", "hi"), r1, Message("user", "more")], QWEN.codec.encode("ok<|im_end|>"))
    assert p2[: len(p1) + len(odd)] == p1 + odd
    (s,) = t.samples()
    assert s.response_ids[: len(odd)] == odd
    head = t.head
    assert head is not None
    expected = QWEN.encode_messages(t.messages(head), add_generation_prompt=False)
    assert classify(expected, closed_row(t.row(head), QWEN), QWEN) == ["assistant_text"]


@pytest.mark.parametrize(
    ("drift", "matcher"),
    [
        ("key_order_and_whitespace", "loose_tool_call"),
        ("dropped_reasoning", "strict"),
        ("extra_newline", "strict"),
        ("ids_regenerated", "strict"),
    ],
)
def test_harness_drift_keeps_training_tokens_equal_to_sampled(drift: str, matcher: str) -> None:
    t = tree(matcher=matcher, family=QWEN)
    o1 = QWEN.codec.encode(
        '<think>\nadd them\n</think>\n\nSure.\n<tool_call>\n{"name": "calc", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
    )
    _, r1 = turn(t, [USER], o1)
    assert r1.reasoning == "add them" and r1.content == "Sure."
    replay = {
        "key_order_and_whitespace": Message(
            "assistant", r1.content, r1.reasoning, (ToolCall("calc", '{"b":3,"a":2}'),)
        ),
        "dropped_reasoning": Message("assistant", r1.content, "", r1.tool_calls),
        "extra_newline": Message("assistant", r1.content + "\n", r1.reasoning, r1.tool_calls),
        "ids_regenerated": Message(
            "assistant", r1.content, r1.reasoning, (ToolCall("calc", r1.tool_calls[0].arguments, "x"),)
        ),
    }[drift]
    o2 = QWEN.codec.encode("5<|im_end|>")
    turn(t, [USER, replay, Message("tool", "5")], o2)
    (s,) = t.samples()
    sampled = [tok for tok, m in zip(s.response_ids, s.loss_mask, strict=True) if m]
    assert sampled == o1 + o2


def test_strict_refuses_reserialized_arguments_and_names_the_field() -> None:
    t = tree(family=QWEN)
    o1 = QWEN.codec.encode(
        '<tool_call>\n{"name": "calc", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
    )
    _, _r1 = turn(t, [USER], o1)
    drifted = Message("assistant", "", "", (ToolCall("calc", '{"b": 3, "a": 2}'),))
    with pytest.raises(SessionError, match=r"messages\[1\] \(assistant\).*tool_calls") as e:
        t.plan([USER, drifted, Message("tool", "5")])
    assert e.value.status == 400


def test_linear_allows_one_rollback_and_refuses_an_earlier_fork() -> None:
    t = tree()
    _, r1 = turn(t, [USER], TINY.codec.encode("a<|eos|>"))
    _, r2 = turn(t, [USER, r1, Message("user", "b")], TINY.codec.encode("c<|eos|>"))
    _, r3 = turn(t, [USER, r1, Message("user", "b"), r2, Message("user", "d")], TINY.codec.encode("e<|eos|>"))
    # Retry the newest turn with a different user message: allowed, the old turn is discarded.
    turn(t, [USER, r1, Message("user", "b"), r2, Message("user", "D")], TINY.codec.encode("f<|eos|>"))
    (s,) = t.samples()
    assert TINY.codec.decode(s.response_ids).endswith("<|user|>D<|assistant|>f<|eos|>")
    with pytest.raises(SessionError) as e:
        t.plan([USER, r1, Message("user", "X")])
    assert e.value.status == 409 and "mode=branching" in str(e.value)
    assert r3.content == "e"


def test_branching_counts_each_generated_span_once() -> None:
    t = tree(mode="branching")
    o1 = TINY.codec.encode("ab<|eos|>")
    _, r1 = turn(t, [USER], o1)
    o2, o3 = TINY.codec.encode("c<|eos|>"), TINY.codec.encode("de<|eos|>")
    turn(t, [USER, r1, Message("user", "x")], o2)
    turn(t, [USER, r1, Message("user", "y")], o3)  # a sibling: forks after turn 1
    turn(t, [Message("user", "sub-agent prompt")], TINY.codec.encode("z<|eos|>"))  # a new root
    samples = t.samples()
    assert len(samples) == 3
    trained = sum(sum(s.loss_mask) for s in samples)
    assert trained == len(o1) + len(o2) + len(o3) + 2  # every generated token exactly once
    first, second = samples[0], samples[1]
    assert first.loss_mask[: len(o1)] == [1] * len(o1)
    assert second.loss_mask[: len(o1)] == [0] * len(o1)  # shared span: only on the earliest leaf
    assert second.response_ids[: len(o1)] == o1


def test_branching_refuses_to_extend_a_truncated_leaf_and_caps_nodes() -> None:
    t = tree(mode="branching", max_nodes=2)
    _, r1 = turn(t, [USER], TINY.codec.encode("abc"), finish="length")
    with pytest.raises(SessionError) as e:
        t.plan([USER, r1, Message("user", "go on")])
    assert e.value.status == 409 and "finish_reason=length" in str(e.value)
    turn(t, [Message("user", "other")], TINY.codec.encode("q<|eos|>"))
    with pytest.raises(SessionError, match="max_nodes=2"):
        t.plan([Message("user", "third")])


def test_glm_keeps_the_sampled_stop_token_that_is_also_the_next_opener() -> None:
    t = tree(family=GLM)
    o1 = GLM.codec.encode(
        "<think>x</think><tool_call>calc<arg_key>a</arg_key><arg_value>2</arg_value></tool_call><|observation|>"
    )
    p1, r1 = turn(t, [USER], o1)
    assert r1.tool_calls[0].arguments_obj() == {"a": 2}
    p2, _ = turn(t, [USER, r1, Message("tool", "2")], GLM.codec.encode("2<|user|>"))
    assert p2 == GLM.encode_messages([USER, r1, Message("tool", "2")], add_generation_prompt=True)
    assert p2[: len(p1) + len(o1)] == p1 + o1  # the boundary appears once, as sampled
    (s,) = t.samples()
    assert s.loss_mask[len(o1) - 1] == 1 and s.rollout_logprobs[len(o1) - 1] != 0.0


def test_role_content_only_merges_different_tool_calls() -> None:
    """Why role_content_only is risky: a call the agent never made on this path is kept."""
    t = tree(matcher="role_content_only")
    _, _r1 = turn(t, [USER], TINY.codec.encode(CALL + "<|eos|>"))
    other = Message("assistant", "", "", (ToolCall("delete_everything", "{}"),))
    plan = t.plan([USER, other, Message("tool", "5")])
    assert plan.parent is t.head  # matched: the stored calc call wins over the replayed one
    strict_tree = tree()
    turn(strict_tree, [USER], TINY.codec.encode(CALL + "<|eos|>"))
    with pytest.raises(SessionError):
        strict_tree.plan([USER, other, Message("tool", "5")])


def test_an_abandoned_plan_leaves_the_checkpoint_unchanged() -> None:
    for family in (TINY, GLM):
        t = tree(family=family)
        stop = "<|eos|>" if family is TINY else "<|user|>"  # GLM: a real 1-token trim (next is a tool)
        _, r1 = turn(t, [USER], family.codec.encode("ab" + stop))
        head = t.head
        assert head is not None
        before = t.row(head)
        plan = t.plan([USER, r1, Message("tool", "5")])
        assert len(plan.input_ids) > len(before)
        t.abandon(plan)  # e.g. the engine failed
        assert t.row(head) == before
        assert t.plan([USER, r1, Message("tool", "5")]).input_ids[: len(before) - 1] == before[:-1]


def test_no_turn_means_no_sample_and_bad_requests_name_the_fix() -> None:
    t = tree()
    with pytest.raises(SessionError) as e:
        t.samples()
    assert e.value.status == 422
    with pytest.raises(SessionError, match="not in the vocabulary"):
        t.plan([Message("user", "ünïcode")])
    _, r1 = turn(t, [USER], TINY.codec.encode("a<|eos|>"))
    with pytest.raises(SessionError, match="append a tool or user message"):
        t.plan([USER, r1])


def test_mismatch_classes_point_at_bugs() -> None:
    msgs = [Message("user", "hi"), Message("assistant", "yo")]
    good = TINY.encode_messages(msgs, add_generation_prompt=False)
    assert classify(good, good, TINY) == []
    assert classify(good, good[:-1], TINY) == ["special_token_count"]
    swapped = [4 if x == 2 else x for x in good]  # <|user|> became <|tool|>
    assert classify(good, swapped, TINY) == ["special_token_type"]
    user_text = TINY.encode_messages([Message("user", "ho"), msgs[1]], add_generation_prompt=False)
    assert classify(good, user_text, TINY) == ["non_assistant_text"]
    reply_text = TINY.encode_messages([msgs[0], Message("assistant", "ya")], add_generation_prompt=False)
    assert classify(good, reply_text, TINY) == ["assistant_text"]


def test_r3_routing_data_of_the_leaf_request_covers_the_trajectory() -> None:
    t = tree()
    plan = t.plan([USER])
    ids = TINY.codec.encode("a<|eos|>")
    first = TurnOutput(ids, [-0.1] * 2, [0] * 2, "stop", routed_experts=b"\x01" * 8)
    parsed = TINY.parse_reply(TINY.codec.decode(ids))
    node = t.commit(plan, Message("assistant", parsed.content), first)
    plan2 = t.plan([USER, Message("assistant", "a"), Message("user", "b")])
    second = TurnOutput(ids, [-0.1] * 2, [0] * 2, "stop", routed_experts=b"\x02" * 8)
    t.commit(plan2, Message("assistant", "a"), second)
    assert node.routed_experts is None  # the child's request covers the parent's tokens
    (s,) = t.samples()
    assert s.routed_experts == b"\x02" * 8


def test_engine_reporting_fewer_logprobs_than_tokens_is_refused() -> None:
    t = tree()
    plan = t.plan([USER])
    bad = TurnOutput([7, 8, 1], [-0.1, -0.2], [0, 0, 0], "stop")
    with pytest.raises(SessionError) as e:
        t.commit(plan, Message("assistant", "x"), bad)
    assert e.value.status == 502


def test_mismatch_flags_a_broken_seam_merge_as_a_bug() -> None:
    msgs = [
        Message("user", "hi"),
        Message("assistant", "yo"),
        Message("user", "again"),
        Message("assistant", "ok"),
    ]
    good = QWEN.encode_messages(msgs, add_generation_prompt=False)
    nl, im_end = QWEN.codec.encode("\n")[0], QWEN.codec.encode("<|im_end|>")[0]
    first_close = good.index(im_end, good.index(im_end) + 1)  # the first assistant turn's <|im_end|>
    assert good[first_close + 1] == nl
    no_newline = good[: first_close + 1] + good[first_close + 2 :]  # a merge that forgot the "\n"
    assert classify(good, no_newline, QWEN) == ["non_assistant_text"]


def test_tools_are_rendered_once_and_fixed_for_the_session() -> None:
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    t = tree(family=QWEN)
    plan = t.plan([Message("system", "Be brief."), USER], tools)
    text = QWEN.codec.decode(plan.input_ids)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"name": "calc"' in text
    t.commit(plan, Message("assistant", "ok"), out(QWEN.codec.encode("ok<|im_end|>")))
    history = [Message("system", "Be brief."), USER, Message("assistant", "ok"), Message("user", "more")]
    assert t.plan(history, tools).reused > 0
    with pytest.raises(SessionError, match="keep them fixed"):
        t.plan(history, [])
