"""The toolcalc agent: one episode through the session server with the real `openai` client.

Why it exists: it is the agent a harness would be: it sends plain chat messages (replaying the whole
history each turn, as OpenAI-style agents do), runs the `calc` tool on the model's calls, and never
sees a token ID. The session server keeps the tokens; at the end the agent asks it for the
token-exact sample and copies it into the driver's Sample.

Contract: `run_episode(session_url, sample, ...)` is called by an AgentFn (see
lockstep.rollout.session.local.toolcalc_agent, which starts an in-process session server when the
driver runs none). It fills prompt_ids, response_ids, loss_mask, rollout_logprobs, token_versions and
status, and stores the episode summary in sample.metadata["toolcalc"] for the reward.

Who calls it: lockstep.rollout.session.local, tests.
"""

from __future__ import annotations

import json
from typing import Any, cast

import httpx

from lockstep.api.auth import api_key_from_env, auth_headers
from lockstep.tasks.toolcalc.env import CALC_TOOL, calc
from lockstep.types import Sample


def _arguments(raw: str) -> tuple[dict[str, Any], bool]:
    try:
        obj = json.loads(raw)
    except ValueError:
        return {}, False
    return (obj, True) if isinstance(obj, dict) else ({}, False)


async def run_episode(
    session_url: str,
    sample: Sample,
    *,
    max_turns: int = 3,
    max_tokens: int = 64,
    temperature: float = 1.0,
) -> Sample:
    """Play one toolcalc episode for `sample` (its metadata["item"] holds the prompt messages)."""
    import openai

    item = sample.metadata["item"]
    messages: list[dict[str, Any]] = [dict(m) for m in item.messages]
    key = api_key_from_env()  # the session server requires the job's key when the job has one
    async with httpx.AsyncClient(timeout=600, headers=auth_headers(key)) as http:
        created = await http.post(f"{session_url}/sessions", json={"mode": "linear"})
        created.raise_for_status()
        sid = created.json()["session_id"]
        client = openai.AsyncOpenAI(
            base_url=f"{session_url}/sessions/{sid}/v1", api_key=key or "unused", max_retries=0
        )
        called = well_formed = False
        final = ""
        try:
            for _ in range(max_turns):
                resp = await client.chat.completions.create(
                    model="policy",
                    messages=cast(Any, messages),
                    tools=cast(Any, [CALC_TOOL]),
                    max_tokens=max_tokens,
                    temperature=temperature,
                )
                choice = resp.choices[0]
                msg = choice.message
                calls = msg.tool_calls or []
                messages.append(msg.model_dump(exclude_none=True, exclude={"refusal"}))
                if not calls or choice.finish_reason == "length":
                    final = msg.content or ""
                    break
                for call in calls:
                    fn = getattr(call, "function", None)
                    args, ok = _arguments(fn.arguments if fn is not None else "")
                    is_calc = fn is not None and fn.name == "calc"
                    called = called or is_calc
                    well_formed = well_formed or (is_calc and ok and "expression" in args)
                    result = calc(args) if is_calc else f"error: unknown tool {fn.name if fn else '?'}"
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            got = await http.post(f"{session_url}/sessions/{sid}/samples", json={})
            got.raise_for_status()
        finally:
            await client.close()
            await http.delete(f"{session_url}/sessions/{sid}")
    (traj,) = got.json()["samples"]
    sample.take_trajectory(traj)
    sample.metadata["toolcalc"] = {"called_calc": called, "well_formed": well_formed, "final": final}
    return sample
