"""The session server end to end: the real openai client as the agent, the real reference engine.

Harness drift is injected into the replayed history (re-serialized tool-call JSON with other key
order and whitespace, regenerated call ids, an extra newline, content null vs ""); in every case the
trained tokens must equal what the engine sampled, which we check independently by asking the
engine again (greedy) for each trained span given the served prefix.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import httpx
import openai
import pytest
import pytest_asyncio
from lockstep.models.tiny import chat_tokenizer
from lockstep.rollout.session.engine import ReplicaPool
from lockstep.rollout.session.server import SessionServer, SessionServerConfig
from lockstep.serving import EngineClient, SamplingParams

TOK = chat_tokenizer()
USER = {"role": "user", "content": "add 2 and 3"}


@pytest_asyncio.fixture
async def server(engine_url: str) -> AsyncIterator[SessionServer]:
    srv = SessionServer(
        SessionServerConfig(family="tiny", temperature=0.0, max_new_tokens=80), ReplicaPool([engine_url])
    )
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


async def new_session(srv: SessionServer, **opts: Any) -> str:
    async with httpx.AsyncClient() as h:
        r = await h.post(f"{srv.url}/sessions", json=opts)
        r.raise_for_status()
        return str(r.json()["session_id"])


async def chat(client: openai.AsyncOpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    """One chat completion through the real openai client (messages as plain dicts, as harnesses send)."""
    return await client.chat.completions.create(model="tiny", messages=cast(Any, messages), **kw)


def agent(srv: SessionServer, sid: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{srv.url}/sessions/{sid}/v1", api_key="unused", max_retries=0)


async def samples(srv: SessionServer, sid: str) -> httpx.Response:
    async with httpx.AsyncClient() as h:
        return await h.post(f"{srv.url}/sessions/{sid}/samples", json={})


async def assert_trained_tokens_were_sampled(engine_url: str, sample: dict[str, Any]) -> None:
    """Each loss-masked span is what the engine samples (greedy) after the served prefix."""
    row = sample["prompt_ids"] + sample["response_ids"]
    p = len(sample["prompt_ids"])
    mask = sample["loss_mask"]
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(mask):
        if m and (i == 0 or not mask[i - 1]):
            spans.append((i, i))
        if m:
            spans[-1] = (spans[-1][0], i + 1)
    assert spans, "no trained tokens"
    async with EngineClient(engine_url) as eng:
        for a, b in spans:
            res = await eng.generate(row[: p + a], SamplingParams(temperature=0.0, max_new_tokens=b - a))
            assert res.output_ids == sample["response_ids"][a:b]
            assert res.output_logprobs == pytest.approx(sample["rollout_logprobs"][a:b], abs=1e-4)


def drifted(call: Any, drift: str, message: Any = None) -> dict[str, Any]:
    """The replayed assistant message as a harness with `drift` would send it."""
    if drift == "full_model_dump":  # the openai response message replayed as is (null fields and all)
        return dict(message.model_dump())
    args = call.function.arguments
    fn = {"name": call.function.name, "arguments": args}
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call.id, "type": "function", "function": fn}],
    }
    if drift == "key_order_and_whitespace":
        fn["arguments"] = '{ "b": 3,\n  "a": 2 }'
    elif drift == "ids_regenerated":
        msg["tool_calls"][0]["id"] = "call_from_my_harness"
    elif drift == "content_empty_string_and_newline":
        msg["content"] = "\n"
    return msg


@pytest.mark.parametrize(
    ("drift", "matcher"),
    [
        ("none", "strict"),
        ("key_order_and_whitespace", "loose_tool_call"),
        ("ids_regenerated", "strict"),
        ("content_empty_string_and_newline", "strict"),
        ("full_model_dump", "strict"),
    ],
)
async def test_tool_turns_train_on_exactly_the_sampled_tokens(
    server: SessionServer, engine_url: str, conversations: tuple[str, ...], drift: str, matcher: str
) -> None:
    sid = await new_session(server, matcher=matcher)
    client = agent(server, sid)
    first = await chat(client, [USER], temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "calc"
    args = call.function.arguments
    assert eval_calc(args) == "5"
    history = [
        USER,
        drifted(call, drift, choice.message),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    second = await chat(client, history, logprobs=True)
    assert second.choices[0].message.content == "the sum is 5"
    returned = second.choices[0].logprobs.content  # asked for with logprobs=True
    assert "".join(t.token for t in returned) == "the sum is 5<|eos|>"
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # affinity: the replica had C_1 cached

    r = await samples(server, sid)
    assert r.status_code == 200
    (s,) = r.json()["samples"]
    assert TOK.decode(s["prompt_ids"] + s["response_ids"]) == conversations[0]
    assert s["mismatch"] == []
    assert sum(s["loss_mask"]) == len(TOK.encode(conversations[0].split("<|assistant|>", 1)[1])) - len(
        TOK.encode("<|tool|>5<|assistant|>")
    )
    assert all(v == 0 for v, m in zip(s["token_versions"], s["loss_mask"], strict=True) if m)
    await assert_trained_tokens_were_sampled(engine_url, s)


def eval_calc(arguments: str) -> str:
    import json

    a = json.loads(arguments)
    return str(a["a"] + a["b"])


async def test_forbidden_and_invalid_requests_are_rejected_with_the_field_named(
    server: SessionServer,
) -> None:
    sid = await new_session(server)
    url = f"{server.url}/sessions/{sid}/v1/chat/completions"
    async with httpx.AsyncClient() as h:
        cases = [
            ({"messages": [USER], "input_ids": [1, 2]}, "input_ids"),
            ({"messages": [{**USER, "token_ids": [3]}]}, "messages[0].token_ids"),
            ({"messages": [USER], "prompt_offsets": [0]}, "prompt_offsets"),
            ({"messages": [USER], "temprature": 0.5}, "temprature"),
            ({"messages": [USER], "stream": True}, "stream"),
            ({"messages": [USER], "n": 2}, "n"),
            ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ]
        for body, field in cases:
            r = await h.post(url, json=body)
            assert r.status_code == 400, body
            assert field in r.json()["error"]["message"]
        r = await h.post(f"{server.url}/sessions/nope/v1/chat/completions", json={"messages": [USER]})
        assert r.status_code == 404
        assert (await h.get(f"{server.url}/sessions/nope")).status_code == 404
        assert (await h.post(f"{server.url}/sessions", json={"mode": "tree"})).status_code == 400
    assert (await samples(server, sid)).status_code == 422  # no turn yet


async def test_strict_refuses_drifted_tool_json_and_linear_refuses_an_old_fork(server: SessionServer) -> None:
    sid = await new_session(server)
    client = agent(server, sid)
    hi = {"role": "user", "content": "hi"}
    first = await chat(client, [hi])
    reply = {"role": "assistant", "content": first.choices[0].message.content}
    assert reply["content"] == "hello"
    second = await chat(
        client,
        [hi, reply, {"role": "user", "content": "bye"}],
    )
    assert second.choices[0].message.content == "bye now"
    with pytest.raises(openai.ConflictError, match="mode=branching"):
        await chat(
            client,
            [{"role": "user", "content": "other start"}],  # forks before turn 1: two turns back
        )
    with pytest.raises(openai.BadRequestError, match="content differs"):
        await chat(
            client,
            [hi, {"role": "assistant", "content": "HELLO"}, {"role": "user", "content": "x"}],
        )


async def test_branching_session_trains_each_shared_span_once(server: SessionServer, engine_url: str) -> None:
    sid = await new_session(server, mode="branching")
    client = agent(server, sid)
    first = await chat(client, [USER], max_tokens=60)
    (call,) = first.choices[0].message.tool_calls or []
    base = [USER, drifted(call, "none")]
    for result in ("5", "6"):
        await chat(
            client,
            [*base, {"role": "tool", "tool_call_id": call.id, "content": result}],
            max_tokens=20,
        )
    r = await samples(server, sid)
    a, b = r.json()["samples"]
    first_len = len(TOK.encode(TOOL_CALL_EOS))
    assert a["response_ids"][:first_len] == b["response_ids"][:first_len]
    assert a["loss_mask"][:first_len] == [1] * first_len
    assert b["loss_mask"][:first_len] == [0] * first_len  # the shared call is trained once
    async with httpx.AsyncClient() as h:
        info = (await h.get(f"{server.url}/sessions/{sid}")).json()
    assert info["turns"] == 3 and info["leaves"] == 2
    assert 0.0 < info["prefix_cache_hit_rate"] <= 1.0
    await assert_trained_tokens_were_sampled(engine_url, a)
    await assert_trained_tokens_were_sampled(engine_url, b)


TOOL_CALL_EOS = '<call>{"name":"calc","arguments":{"a":2,"b":3}}</call><|eos|>'


async def test_engine_failure_is_a_502_and_metrics_are_exported(server: SessionServer) -> None:
    dead = SessionServer(SessionServerConfig(family="tiny"), ReplicaPool(["http://127.0.0.1:9"]))
    await dead.start()
    try:
        sid = await new_session(dead)
        with pytest.raises(openai.InternalServerError) as e:
            await chat(agent(dead, sid), [USER])
        assert e.value.status_code == 502
    finally:
        await dead.stop()
    sid = await new_session(server)
    await chat(agent(server, sid), [USER])
    assert (await samples(server, sid)).status_code == 200
    async with httpx.AsyncClient() as h:
        quick = await h.post(f"{server.url}/sessions/{sid}/samples", json={"check_mismatch": False})
        assert quick.json()["samples"][0]["mismatch"] is None  # diagnostic skipped, not counted
        assert (await h.post(f"{server.url}/sessions/{sid}/samples", json={"bogus": 1})).status_code == 400
        text = (await h.get(f"{server.url}/metrics")).text
    assert 'tito_session_mismatch_total{type="special_token_count"} 0.0' in text
    assert "tito_session_checks_total 1.0" in text
    assert "tito_turn_overhead_seconds_count 1.0" in text


async def test_a_session_that_names_no_mode_takes_the_servers_default(engine_url: str) -> None:
    """In a job the default is spec.rollout.session (lockstep.rollout.session.local); a body still wins."""
    config = SessionServerConfig(family="tiny", mode="branching", matcher="loose_tool_call", max_nodes=3)
    srv = SessionServer(config, ReplicaPool([engine_url]))
    await srv.start()
    try:
        async with httpx.AsyncClient() as h:
            default, linear = await new_session(srv), await new_session(srv, mode="linear")
            assert (await h.get(f"{srv.url}/sessions/{default}")).json()["mode"] == "branching"
            assert (await h.get(f"{srv.url}/sessions/{linear}")).json()["mode"] == "linear"
        tree = srv.sessions[default].tree
        assert tree.max_nodes == 3 and srv.sessions[linear].tree.max_nodes == 3
    finally:
        await srv.stop()
