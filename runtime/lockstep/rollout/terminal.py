"""The terminal agent: the model works a shell task in its own sandbox through the TITO session server.

Why it exists: agentic RL (§3, §9) trains a model that acts in a terminal. One episode: claim a
fresh sandbox, run the task's setup script, then turn by turn the model proposes a command as an `sh`
tool call, the sandbox runs it and its output (cut to the sandbox's output limit, exit status and
timeouts noted) returns as the tool result, until the model answers without a call, hits the turn
limit (spec.agent.maxTurns) or the episode's deadline (spec.agent.timeoutSeconds). Then the task's
test script runs in the same sandbox and its exit status is the reward; the claim is released
whatever happened.

Token-exactness (TITO): the agent sends only chat messages to the session server, which keeps the
sampled IDs; the sample is the server's token row (tool results have loss mask 0), so the trained
tokens are exactly the sampled ones.

Failures: a sandbox that cannot be claimed, dies or stops answering (SandboxError), or a setup script
that fails, aborts this one sample (status ABORTED, never trained on, counted by `episode_metrics`);
the job goes on. A command that fails or times out is the model's doing and is shown to it.

Manifest: spec.agent.sandbox set (the driver then defaults spec.agent.agentFunction to
`lockstep.rollout.terminal:terminal_agent` and the reward to the test script's verdict).
Who calls it: lockstep.rollout.generate (as the agent function), tests, bench.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from lockstep.api.auth import api_key_from_env, auth_headers
from lockstep.api.sandbox import DEFAULT_EPISODE_SECONDS, DEFAULT_MAX_TURNS
from lockstep.rollout.generate import sample_seed
from lockstep.rollout.session.local import session_url_for
from lockstep.sandbox.base import ExecResult, Sandbox, SandboxError, SandboxProvider
from lockstep.tasks.shell.rows import SANDBOX_KEY, SH_TOOL
from lockstep.types import Sample, SampleStatus

log = logging.getLogger(__name__)


async def terminal_agent(ctx: Any, sample: Sample) -> Sample:
    """AgentFn: one shell-task episode in a sandbox of ctx.sandboxes (see the module doc)."""
    sandboxes: SandboxProvider | None = getattr(ctx, "sandboxes", None)
    if sandboxes is None:
        raise ValueError(
            "spec.agent.agentFunction: the terminal agent runs commands in a sandbox; set spec.agent.sandbox"
        )
    url = await session_url_for(ctx)
    return await run_episode(
        url,
        sandboxes,
        sample,
        max_turns=ctx.max_turns or DEFAULT_MAX_TURNS,
        timeout_s=ctx.timeout_s or float(DEFAULT_EPISODE_SECONDS),
        max_tokens=ctx.sampling.max_new_tokens,
        temperature=ctx.sampling.temperature,
        seed=sample_seed(ctx.seed, sample.group_index, sample.index),
        printable=printable_for(ctx.encode),
    )


def episode_key(sample: Sample) -> str:
    """The episode's name in sandbox names and labels: group and sample index."""
    return f"g{sample.group_index}-s{sample.index}"


async def run_episode(
    session_url: str,
    sandboxes: SandboxProvider,
    sample: Sample,
    *,
    max_turns: int,
    timeout_s: float,
    max_tokens: int,
    temperature: float = 1.0,
    seed: int | None = None,
    printable: Callable[[str], str] = lambda s: s,
) -> Sample:
    """Play one episode of the shell task in sample.metadata (setup, test) and fill `sample` from the
    session server's token row; the test's verdict goes to sample.metadata[SANDBOX_KEY]."""
    summary: dict[str, Any] = {
        "turns": 0, "commands": 0, "command_timeouts": 0, "test_exit": None, "prompt_tokens": 0, "cached_tokens": 0,
    }  # fmt: skip
    sample.metadata[SANDBOX_KEY] = summary
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    try:
        async with sandboxes.claim(episode_key(sample)) as box:
            summary["claim_s"] = time.monotonic() - t0
            setup = sample.metadata.get("setup")
            if setup:
                done = await box.exec(setup)
                if done.exit_code != 0:
                    raise SandboxError(
                        f"the task's setup script exited {done.exit_code}: {done.output[-200:]!r}",
                        "SetupFailed",
                    )
            limits = _Limits(deadline, max_turns, max_tokens, temperature, seed,
                             sandboxes.config.command_timeout_s)  # fmt: skip
            traj = await _play(session_url, box, sample, summary, limits, printable)
            if traj is None:  # the deadline came before the first turn: nothing was sampled
                raise SandboxError(f"the episode's {timeout_s:g} s passed before its first turn", "Deadline")
            test = await box.exec(str(sample.metadata["test"]))
            summary["test_exit"] = test.exit_code
            summary["test_output"] = test.output[-500:]
    except SandboxError as e:
        log.warning("sample %d/%d aborted: sandbox %s: %s", sample.group_index, sample.index, e.reason, e)
        summary["aborted"] = e.reason
        summary["error"] = str(e)
        _abort(sample)
        return sample
    summary["episode_s"] = time.monotonic() - t0
    sample.take_trajectory(traj)
    return sample


@dataclass(frozen=True, slots=True)
class _Limits:
    """One episode's limits."""

    deadline: float
    """time.monotonic() at which the episode stops taking turns."""
    max_turns: int
    max_tokens: int
    temperature: float
    seed: int | None
    command_timeout_s: float


async def _play(
    url: str,
    box: Sandbox,
    sample: Sample,
    summary: dict[str, Any],
    limits: _Limits,
    printable: Callable[[str], str],
) -> dict[str, Any] | None:
    """The turns of one episode on one session; returns the session's one trajectory (None when no
    turn was taken)."""
    import openai

    messages: list[dict[str, Any]] = [dict(m) for m in sample.metadata["item"].messages]
    http = _http_client()  # a turn may wait for a busy engine, a connect for a busy event loop (openai's
    # default connect timeout of 5 s failed episodes on a loaded 2-core machine)
    created = await http.post(f"{url}/sessions", json={"mode": "linear"})
    created.raise_for_status()
    sid = created.json()["session_id"]
    key = api_key_from_env()  # the session server requires the job's key when the job has one
    client = openai.AsyncOpenAI(
        base_url=f"{url}/sessions/{sid}/v1", api_key=key or "unused", max_retries=0, http_client=http
    )
    try:
        for turn in range(limits.max_turns):
            left = limits.deadline - time.monotonic()
            if left <= 0:
                summary["deadline"] = True
                break
            resp = await client.chat.completions.create(
                model="policy",
                messages=cast(Any, messages),
                tools=cast(Any, [SH_TOOL]),
                max_tokens=limits.max_tokens,
                temperature=limits.temperature,
                seed=None if limits.seed is None else limits.seed + turn,
            )
            summary["turns"] += 1
            _count_usage(summary, resp.usage)
            choice = resp.choices[0]
            calls = choice.message.tool_calls or []
            messages.append(choice.message.model_dump(exclude_none=True, exclude={"refusal"}))
            if not calls or choice.finish_reason == "length":
                break
            for call in calls:
                fn = getattr(call, "function", None)
                result = await _run_call(box, fn, limits, summary)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": printable(result)})
        if not summary["turns"]:
            return None
        got = await http.post(f"{url}/sessions/{sid}/samples", json={})
        got.raise_for_status()
    finally:
        await http.delete(f"{url}/sessions/{sid}")
    (traj,) = got.json()["samples"]
    return cast(dict[str, Any], traj)


def _count_usage(summary: dict[str, Any], usage: Any) -> None:
    """Add a turn's prompt tokens and those the engine's prefix cache served (the session server's
    `usage`, SGLang's cached_tokens) to the episode's summary."""
    if usage is None:
        return
    summary["prompt_tokens"] += int(usage.prompt_tokens or 0)
    details = getattr(usage, "prompt_tokens_details", None)
    summary["cached_tokens"] += int(getattr(details, "cached_tokens", 0) or 0)


_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()


def _http_client() -> Any:
    """One HTTP client per event loop for every episode's session calls (and the openai client's): a
    client per episode built an SSL context each time (~60 ms of CPU), which dominated a one-machine
    episode. It is the openai package's own client class, so the openai client can share it."""
    import openai

    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None or client.is_closed:
        client = openai.DefaultAsyncHttpxClient(
            timeout=openai.Timeout(600.0, connect=120.0), headers=auth_headers(api_key_from_env())
        )
        _clients[loop] = client
    return client


async def _run_call(box: Sandbox, fn: Any, limits: _Limits, summary: dict[str, Any]) -> str:
    """Run one `sh` call; the text the model reads back (an error for anything but a valid call)."""
    if fn is None or fn.name != "sh":
        return f"error: unknown tool {getattr(fn, 'name', '?')}; call sh with cmd"
    try:
        args = json.loads(fn.arguments or "{}")
    except ValueError:
        return 'error: arguments must be JSON like {"cmd": "ls"}'
    cmd = args.get("cmd") if isinstance(args, dict) else None
    if not isinstance(cmd, str) or not cmd.strip():
        return 'error: pass the command as {"cmd": "ls"}'
    left = max(limits.deadline - time.monotonic(), 0.001)  # a command never outlives the episode
    done = await box.exec(cmd, timeout_s=min(left, limits.command_timeout_s))
    summary["commands"] += 1
    summary["command_timeouts"] += int(done.timed_out)
    return tool_text(done)


def tool_text(done: ExecResult) -> str:
    """What the model reads for a finished command (pure): its output, then notes on cut output, a
    timeout or a non-zero exit status."""
    notes = []
    if done.truncated:
        notes.append("[output cut]")
    if done.timed_out:
        notes.append(f"[timed out after {done.seconds:.0f} s]")
    elif done.exit_code != 0:
        notes.append(f"[exit {done.exit_code}]")
    return done.output + "".join(f"\n{n}" if done.output else n for n in notes)


def printable_for(encode: Callable[[str], list[int]]) -> Callable[[str], str]:
    """Replace the characters the model's tokenizer cannot represent with '?' (a byte-level vocabulary
    keeps everything; the tiny character vocabulary has no '|', '$', tab, ...). Tool output is
    environment text: showing it approximately beats refusing the turn."""
    bad: dict[str, bool] = {}

    def fix(text: str) -> str:
        try:
            encode(text)
            return text
        except ValueError:
            pass
        for ch in set(text) - bad.keys():
            try:
                encode(ch)
                bad[ch] = False
            except ValueError:
                bad[ch] = True
        return "".join("?" if bad[ch] else ch for ch in text)

    return fix


def _abort(sample: Sample) -> None:
    """An aborted sample: no response (never trained on), status ABORTED."""
    sample.response_ids, sample.loss_mask, sample.rollout_logprobs, sample.token_versions = [], [], [], []
    sample.status = SampleStatus.ABORTED


def episode_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Sandbox metrics of finished episodes (pure): aborts (all and by reason), turns, commands,
    command timeouts, test pass rate, claim seconds and the engines' prefix-cache hit ratio over the
    episodes' turns (cached / prompt tokens; session affinity keeps it high). Samples without an
    episode are skipped."""
    eps = [s.metadata[SANDBOX_KEY] for s in samples if isinstance(s.metadata.get(SANDBOX_KEY), Mapping)]
    if not eps:
        return {}
    n = len(eps)
    aborted = [e["aborted"] for e in eps if e.get("aborted")]
    ran = [e for e in eps if not e.get("aborted")]
    claims = [float(e["claim_s"]) for e in eps if "claim_s" in e]
    out = {
        "sandbox_episodes": float(n),
        "sandbox_aborted_samples": float(len(aborted)),
        "sandbox_turns_mean": sum(e["turns"] for e in ran) / max(len(ran), 1),
        "sandbox_commands_mean": sum(e["commands"] for e in ran) / max(len(ran), 1),
        "sandbox_command_timeouts": float(sum(e["command_timeouts"] for e in ran)),
        "sandbox_tests_passed_frac": sum(e.get("test_exit") == 0 for e in ran) / max(len(ran), 1),
        "sandbox_claim_seconds_mean": sum(claims) / max(len(claims), 1),
        "sandbox_prefix_cache_hit_ratio": sum(e.get("cached_tokens", 0) for e in ran)
        / max(sum(e.get("prompt_tokens", 0) for e in ran), 1),
    }
    for reason in sorted(set(aborted)):
        out[f"sandbox_aborted_{reason}"] = float(aborted.count(reason))
    return out
