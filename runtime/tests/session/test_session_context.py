"""A multi-turn session whose history nears the context completes against an engine that refuses
over-long requests (stock SGLang's rule, the reference engine's default).

The session server sends each turn through the runtime's EngineClient, which reads the engine's
context from GET /v1/models and lowers the turn's budget to what is left (lockstep.serving.
context_fit). Without that, the last turn below asks for more than fits and the engine answers 400
(shown at the end with the same request sent as it was asked); a history that leaves no room at all
is a 400 `context_length_exceeded` to the agent, never an empty reply.
"""

from __future__ import annotations

from pathlib import Path

import httpx
from aiohttp.test_utils import TestServer
from lockstep.engine.core import ReferenceEngine
from lockstep.engine.server import create_app
from lockstep.rollout.session.engine import ReplicaPool
from lockstep.rollout.session.server import SessionServer, SessionServerConfig

CONTEXT = 128
ASK = 24


async def test_a_session_whose_history_nears_the_context_still_completes(trained_tiny: Path) -> None:
    engine = ReferenceEngine.load(trained_tiny, max_running_requests=4, context_length=CONTEXT)
    assert not engine.allow_auto_truncate  # SGLang's default: beyond the context is a 400
    backend = TestServer(create_app(engine), host="127.0.0.1")
    await backend.start_server()
    url = str(backend.make_url("")).rstrip("/")
    server = SessionServer(
        SessionServerConfig(family="tiny", temperature=0.0, max_new_tokens=ASK), ReplicaPool([url])
    )
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            chat = f"/sessions/{sid}/v1/chat/completions"
            messages = [{"role": "user", "content": "hi"}]
            first = await http.post(chat, json={"messages": messages})
            assert first.status_code == 200 and first.json()["choices"][0]["finish_reason"] == "stop", (
                first.text
            )
            messages.append(first.json()["choices"][0]["message"])
            used = first.json()["usage"]["prompt_tokens"] + first.json()["usage"]["completion_tokens"]
            # a long user turn: the next prompt leaves fewer than ASK tokens of the context
            messages.append({"role": "user", "content": "x" * (CONTEXT - used - 16)})
            last = await http.post(chat, json={"messages": messages})
            assert last.status_code == 200, last.text
            usage = last.json()["usage"]
            assert CONTEXT - ASK < usage["prompt_tokens"] < CONTEXT  # it would not have fit as asked
            assert usage["prompt_tokens"] + usage["completion_tokens"] <= CONTEXT
            samples = await http.post(f"/sessions/{sid}/samples", json={})
            assert samples.status_code == 200 and samples.json()["samples"], samples.text
            # a conversation that fills the context: the agent is told, no empty reply
            other = (await http.post("/sessions", json={})).json()["session_id"]
            full = [{"role": "user", "content": "y" * CONTEXT}]
            refused = await http.post(f"/sessions/{other}/v1/chat/completions", json={"messages": full})
            assert refused.status_code == 400 and "context_length_exceeded" in refused.text, refused.text
        # the same last turn, asked as it was: the engine refuses it
        body = {"input_ids": [2] * usage["prompt_tokens"], "sampling_params": {"max_new_tokens": ASK}}
        async with httpx.AsyncClient(base_url=url, timeout=60) as raw:
            over = await raw.post("/generate", json=body)
        assert over.status_code == 400 and "exceeds the model's maximum context length" in over.text, (
            over.text
        )
    finally:
        await server.stop()
        await backend.close()
