"""The TITO session server: an aiohttp app between agents and rollout engines (§3).

Endpoints (errors: 404 unknown session, 400 validation or forbidden fields, 409 fork/truncation,
422 a sample cannot be assembled, 502 the engine failed or answered inconsistently):
  POST   /sessions                              -> {"session_id"}  (body: mode, matcher, max_nodes)
  GET    /sessions/{id}                         -> turns, tokens, prefix-cache and reuse counters
  DELETE /sessions/{id}
  POST   /sessions/{id}/v1/chat/completions     OpenAI-compatible, tool calls included
  POST   /sessions/{id}/samples                 -> one trajectory per kept leaf (token-exact)
  GET    /metrics                               Prometheus text (tito_session_mismatch_total, ...)

Each turn: match the replayed messages against the session's checkpoints, tokenize only what was
appended (lockstep.rollout.session.tree), send input_ids to the session's replica with logprobs
forced on (routing data when R3 is enabled), check one logprob per output token, parse the reply into
content / reasoning / tool calls for the agent, and commit C_k = P_k || O_k. The server's own work
per turn (everything but the engine call) is measured into `tito_turn_overhead_seconds`.

Who calls it: `lockstep sessions` (CLI), the driver when a manifest runs a multi-turn agent, tests.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import ValidationError

from lockstep.models.families import get_family
from lockstep.models.registry import Message, ModelFamily, ToolCall
from lockstep.rollout.session.engine import TurnEngine
from lockstep.rollout.session.matcher import get_matcher
from lockstep.rollout.session.mismatch import MISMATCH_TYPES, classify, closed_row
from lockstep.rollout.session.protocol import (
    ChatOptions,
    ChatRequest,
    CreateSession,
    SamplesRequest,
    describe,
    fast_messages,
    forbidden_fields,
)
from lockstep.rollout.session.tree import Node, SessionError, SessionMode, TokenTree, TurnOutput
from lockstep.serving import ContextFull, GenerateResult, SamplingParams
from lockstep.serving.client import EngineError, EngineUnreachable
from lockstep.serving.guard import IDLE_TIMEOUT_S, bearer_middleware, parse_json
from lockstep.serving.http import NoReply
from lockstep.serving.listen import listen
from lockstep.serving.sampling_limits import sampling_problem

_T = TypeVar("_T")


@dataclass(kw_only=True, slots=True)
class SessionServerConfig:
    """Settings of one session server."""

    family: str
    """Model family of the served model (lockstep.models.registry name, e.g. "tiny", "qwen3")."""
    tokenizer_dir: str | None = None
    """The served model's checkpoint dir (its tokenizer.json); None: the family's offline stand-in."""
    max_new_tokens: int = 256
    """Reply budget when the request names none."""
    temperature: float = 1.0
    """Sampling temperature when the request names none (RL samples at 1.0)."""
    capture_routing: bool = False
    """R3: ask the engine for routed experts on every turn and return them with samples."""
    max_sessions: int = 4096
    """Open sessions beyond this are refused (503) until some are deleted."""
    api_key: str | None = None
    """The job's key: required as `Authorization: Bearer <key>` on every route but GET /metrics."""
    max_body_bytes: int = 4 << 20
    """Request body cap (a 64K-token conversation is well under 1 MiB); larger bodies get 413."""
    idle_timeout_s: float = IDLE_TIMEOUT_S
    """Seconds an idle keep-alive connection stays open (the engine's 75 s)."""
    cpu_threads: int = 2
    """Threads for tokenizing, parsing and rendering, so one session's CPU work never stalls the
    event loop that serves every other session."""
    idle_ttl_s: float = 3600.0
    """A session untouched this long is dropped (agents that crash never DELETE); swept on create."""
    mode: str = "linear"
    """Mode of a session whose POST /sessions names none (in a job: spec.rollout.session.mode)."""
    matcher: str = "strict"
    """Matcher of a session whose POST /sessions names none (spec.rollout.session.matcher)."""
    max_nodes: int = 256
    """Node cap of a session whose POST /sessions names none (spec.rollout.session.maxNodes)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.max_sessions < 1 or self.max_body_bytes < 1 or self.cpu_threads < 1:
            raise ValueError("max_sessions, max_body_bytes and cpu_threads must be >= 1")


@dataclass(slots=True)
class Session:
    """One session: its checkpoints and counters."""

    id: str
    """Session id (also the affinity routing key)."""
    tree: TokenTree
    """Checkpoints and turns."""
    created: float
    """Creation time (injected clock, seconds)."""
    last_used: float = 0.0
    """Last request that touched the session (injected clock); drives the idle sweep."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Serializes the turns and reads of this session."""
    prompt_tokens: int = 0
    """Prompt tokens sent to the engine, summed over turns."""
    cached_tokens: int = 0
    """Of those, tokens the engine served from its prefix cache."""
    reused_tokens: int = 0
    """Prompt tokens taken from stored checkpoints (never re-tokenized)."""
    tokenized_tokens: int = 0
    """Prompt tokens tokenized by the server (appended messages, openers, seam bridges)."""


class _Metrics:
    """The server's Prometheus metrics, in a registry of its own (several servers per process in tests)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.mismatch = Counter(
            "tito_session_mismatch", "Trajectories whose held row differs from the canonical render, by type",
            ["type"], registry=self.registry,
        )  # fmt: skip
        self.checks = Counter(
            "tito_session_checks", "Trajectories checked for mismatch", registry=self.registry
        )
        self.prompt = Counter("tito_prompt_tokens", "Prompt tokens sent to engines", registry=self.registry)
        self.cached = Counter(
            "tito_cached_tokens", "Prompt tokens served from prefix caches", registry=self.registry
        )
        self.reused = Counter(
            "tito_reused_tokens", "Prompt tokens reused from checkpoints", registry=self.registry
        )
        self.overhead = Histogram(
            "tito_turn_overhead_seconds", "Server work per turn, engine call excluded",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.25), registry=self.registry,
        )  # fmt: skip
        self.in_flight = Gauge(
            "tito_requests_in_flight",
            "Requests being served (what a shutdown drains)",
            registry=self.registry,
        )
        self.draining = Gauge(
            "tito_draining", "1 while shutting down (new requests get 503)", registry=self.registry
        )
        for t in MISMATCH_TYPES:
            self.mismatch.labels(t)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


class SessionServer:
    """The session server; `await start()` binds it to host:port (port 0 picks a free one)."""

    def __init__(
        self,
        config: SessionServerConfig,
        engine: TurnEngine,
        *,
        clock: Callable[[], float] = time.time,
        perf: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        """Server settings."""
        self.engine = engine
        """Where turns are sampled."""
        self.family: ModelFamily = get_family(config.family, config.tokenizer_dir)
        """Model family of the served model."""
        self.sessions: dict[str, Session] = {}
        """Open sessions by id."""
        self.overheads: list[float] = []
        """Server work per turn in seconds (engine excluded), for benchmarks."""
        self.metrics = _Metrics()
        self._clock = clock
        self._perf = perf
        self._runner: web.AppRunner | None = None
        self._cpu_pool = ThreadPoolExecutor(config.cpu_threads, thread_name_prefix="lockstep-sessions")
        self.in_flight = 0
        """Requests being served now."""
        self.draining = False
        """Shutting down (`drain`): new requests get 503, running ones may finish."""
        self.url = ""
        """Base URL once started, e.g. http://127.0.0.1:41234."""

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._drain_guard, bearer_middleware(self.config.api_key, open_reads={"/metrics"})],
            client_max_size=self.config.max_body_bytes,
        )
        app.router.add_post("/sessions", self._create)
        app.router.add_get("/sessions/{sid}", self._get)
        app.router.add_delete("/sessions/{sid}", self._delete)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        app.router.add_post("/sessions/{sid}/samples", self._samples)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner, bound = await listen(
            self.app(), host, port, shutdown_timeout=2.0, keepalive_timeout=self.config.idle_timeout_s
        )
        self.url = f"http://{host}:{bound}"
        return self.url

    @web.middleware
    async def _drain_guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """503 while draining; otherwise count the request as in flight until its reply is done.
        /metrics is neither refused nor counted: it shows the drain."""
        if request.path == "/metrics":
            return await handler(request)
        if self.draining:
            response = _error(503, "the session server is shutting down; retry on another replica")
            response.headers["Retry-After"] = "5"
            return response
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)

    async def drain(self, timeout_s: float) -> bool:
        """The graceful part of a shutdown (SIGTERM): refuse new requests and let running ones finish
        for up to `timeout_s`; True when none runs any more. `stop()` then cuts off the rest."""
        self.draining = True
        self.metrics.draining.set(1)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight == 0

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.engine.aclose()
        self._cpu_pool.shutdown(wait=False, cancel_futures=True)

    async def _cpu(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run CPU work (tokenizing, parsing, rendering) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu_pool, fn, *args)

    # -- session CRUD ----------------------------------------------------------------------------

    async def _create(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            opts = CreateSession.model_validate_json(raw or b"{}")
        except ValidationError as exc:
            return _error(400, describe(exc))
        self._sweep()
        if len(self.sessions) >= self.config.max_sessions:
            return _error(503, f"{len(self.sessions)} sessions open (max_sessions); delete finished sessions")
        sid = uuid.uuid4().hex
        c = self.config
        tree = TokenTree(
            self.family,
            SessionMode(opts.mode or c.mode),
            get_matcher(opts.matcher or c.matcher),
            opts.max_nodes or c.max_nodes,
        )
        now = self._clock()
        self.sessions[sid] = Session(id=sid, tree=tree, created=now, last_used=now)
        return web.json_response({"session_id": sid})

    def _sweep(self) -> None:
        cutoff = self._clock() - self.config.idle_ttl_s
        for sid in [k for k, v in self.sessions.items() if v.last_used < cutoff and not v.lock.locked()]:
            del self.sessions[sid]

    def _session(self, request: web.Request) -> Session:
        sid = request.match_info["sid"]
        s = self.sessions.get(sid)
        if s is None:
            raise SessionError(f"session {sid!r} not found (create one with POST /sessions)", 404)
        s.last_used = self._clock()
        return s

    async def _get(self, request: web.Request) -> web.Response:
        try:
            s = self._session(request)
        except SessionError as exc:
            return _error(exc.status, str(exc))
        head = s.tree.head
        return web.json_response(
            {
                "session_id": s.id,
                "mode": s.tree.mode.value,
                "turns": s.tree.node_count,
                "leaves": len(s.tree.leaves()),
                "tokens": head.row_len if head is not None else 0,
                "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens,
                "prefix_cache_hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
                "reused_tokens": s.reused_tokens,
                "tokenized_tokens": s.tokenized_tokens,
            }
        )

    async def _delete(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        if self.sessions.pop(sid, None) is None:
            return _error(404, f"session {sid!r} not found")
        return web.json_response({"session_id": sid, "deleted": True})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    # -- one turn --------------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.Response:
        # Server work of a turn = parsing the replayed history + the turn minus the engine call +
        # serializing the reply; waiting for the session lock or the engine is not counted.
        try:
            s = self._session(request)
            raw = await request.read()
            t0 = self._perf()
            msgs, req = await self._cpu(self._parse_chat, raw)
            parse_s = self._perf() - t0
            async with s.lock:
                body, work_s = await self._turn(s, msgs, req)
        except SessionError as exc:
            return _error(exc.status, str(exc))
        t1 = self._perf()
        text = json.dumps(body)
        self._observe(parse_s + work_s + self._perf() - t1)
        return web.Response(text=text, content_type="application/json")

    def _parse_chat(self, raw: bytes) -> tuple[list[Message], ChatOptions]:
        """The replayed messages and the request options, or a 400 naming the bad field."""
        try:
            body = parse_json(raw)
        except ValueError as exc:
            raise SessionError(f"request body is not JSON: {exc}") from exc
        try:
            if isinstance(body, dict) and isinstance(body.get("messages"), list):
                msgs = fast_messages(body["messages"])  # None unless every message is plain
                if msgs is not None:
                    opts = ChatOptions.model_validate({k: v for k, v in body.items() if k != "messages"})
                    return msgs, opts
            req = ChatRequest.model_validate(body)
        except ValidationError as exc:
            bad = forbidden_fields(body)  # token IDs or offsets: say why, not just "extra field"
            if bad:
                raise SessionError(
                    f"{', '.join(bad)}: agents cannot supply token IDs or offsets; the session server "
                    "owns the token row. Send messages only (remove these fields)."
                ) from exc
            raise SessionError(describe(exc)) from exc
        return [m.to_message() for m in req.messages], req

    def _sampling(self, req: ChatOptions) -> SamplingParams:
        cfg = self.config
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        stop_ids = set(self.family.stop_ids)
        strings: list[str] = []
        for text in stops:
            # A stop string that is exactly one token is the same stop as that token ID; sending it
            # as an ID also works on engines without stop-string support (our reference engine).
            ids = self.family.codec.encode(text) if text else []
            if len(ids) == 1:
                stop_ids.add(ids[0])
            elif text:
                strings.append(text)
        temperature = cfg.temperature if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        problem = sampling_problem(temperature, top_p, prefix="")  # float32, as the engine samples
        if problem:
            raise SessionError(problem, 400)
        return SamplingParams(
            max_new_tokens=req.max_completion_tokens or req.max_tokens or cfg.max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=strings or None,
            stop_token_ids=sorted(stop_ids),
            sampling_seed=req.seed,
            skip_special_tokens=False,
        )

    async def _turn(self, s: Session, msgs: list[Message], req: ChatOptions) -> tuple[dict[str, Any], float]:
        """Run one turn; returns the completion body and the seconds of server work (engine excluded)."""
        t0 = self._perf()
        plan = await self._cpu(s.tree.plan, msgs, req.tools or ())
        prompt_len = len(plan.input_ids)
        try:
            sampling = self._sampling(req)
            t1 = self._perf()
            res = await self._generate(s.id, plan.input_ids, sampling)
            t2 = self._perf()
            reply, out = await self._cpu(self._reply, s, res)
            node = s.tree.commit(plan, reply, out)
        except BaseException:
            s.tree.abandon(plan)  # the parent checkpoint stays exactly as it was
            raise
        self._count(s, plan.reused, len(plan.added), prompt_len, res.cached_tokens)
        body = _completion(s.id, node, reply, prompt_len, res.cached_tokens, int(self._clock()))
        if req.logprobs:
            body["choices"][0]["logprobs"] = self._logprobs(node)
        return body, (t1 - t0) + (self._perf() - t2)

    async def _generate(self, sid: str, input_ids: list[int], sampling: SamplingParams) -> GenerateResult:
        try:
            res = await self.engine.generate(sid, input_ids, sampling, self.config.capture_routing)
        except ContextFull as exc:  # the conversation fills the engine's context: the agent's to end
            raise SessionError(f"context_length_exceeded: {exc}", 400) from exc
        except (EngineError, EngineUnreachable, NoReply, ValueError) as exc:
            raise SessionError(f"engine failed: {exc}", 502) from exc
        if res.finish_reason == "abort":  # never a turn: the agent would read an empty reply as `stop`
            raise SessionError(f"engine aborted the turn: {res.abort_message or 'no reason given'}", 502)
        if len(res.output_logprobs) != len(res.output_ids):
            raise SessionError(
                f"engine returned {len(res.output_ids)} completion tokens but {len(res.output_logprobs)} logprobs",
                502,
            )
        if self.config.capture_routing and res.routed_experts is None:
            raise SessionError("R3 is enabled but the engine returned no routed_experts", 502)
        return res

    def _reply(self, s: Session, res: GenerateResult) -> tuple[Message, TurnOutput]:
        """The reply as the agent sees it (parsed from the sampled IDs) and the turn's token record."""
        parsed = self.family.parse_reply(self.family.codec.decode(res.output_ids))
        calls = tuple(
            ToolCall(c.name, c.arguments, f"call_{s.id[:8]}_{s.tree.node_count}_{i}")
            for i, c in enumerate(parsed.tool_calls)
        )
        reply = Message("assistant", parsed.content, parsed.reasoning, calls)
        out = TurnOutput(
            ids=list(res.output_ids),
            logprobs=list(res.output_logprobs),
            versions=list(res.token_versions),
            finish_reason=res.finish_reason,
            routed_experts=res.routed_experts,
            cached_tokens=res.cached_tokens,
        )
        return reply, out

    def _logprobs(self, node: Node) -> dict[str, Any]:
        """OpenAI-shaped logprobs of the sampled tokens (for agents that ask; never read back)."""
        out_ids = node.ids[node.prompt_len :]
        content = []
        for tid, lp in zip(out_ids, node.logprobs, strict=True):
            text = self.family.codec.decode([tid])
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
        return {"content": content, "refusal": None}

    def _count(self, s: Session, reused: int, tokenized: int, prompt: int, cached: int) -> None:
        s.reused_tokens += reused
        s.tokenized_tokens += tokenized
        s.prompt_tokens += prompt
        s.cached_tokens += cached
        self.metrics.prompt.inc(prompt)
        self.metrics.cached.inc(cached)
        self.metrics.reused.inc(reused)

    def _observe(self, seconds: float) -> None:
        self.overheads.append(seconds)
        self.metrics.overhead.observe(seconds)

    # -- samples ---------------------------------------------------------------------------------

    async def _samples(self, request: web.Request) -> web.Response:
        try:
            s = self._session(request)
            try:
                opts = SamplesRequest.model_validate_json(await request.read() or b"{}")
            except ValidationError as exc:
                raise SessionError(describe(exc)) from exc
            async with s.lock:
                samples = s.tree.samples()
                leaves = s.tree.leaves()
                # The diagnostic re-tokenizes the whole conversation (~0.1 s CPU at 64K tokens).
                mismatch = [
                    await self._cpu(self._mismatch, s.tree, leaf) if opts.check_mismatch else None
                    for leaf in leaves
                ]
        except SessionError as exc:
            return _error(exc.status, str(exc))
        out = []
        for smp, types in zip(samples, mismatch, strict=True):
            out.append(
                {
                    "prompt_ids": smp.prompt_ids,
                    "response_ids": smp.response_ids,
                    "loss_mask": smp.loss_mask,
                    "rollout_logprobs": smp.rollout_logprobs,
                    "token_versions": smp.token_versions,
                    "status": smp.status.value,
                    "finish_reason": smp.metadata["finish_reason"],
                    "turns": smp.metadata["turns"],
                    "leaf": smp.metadata["leaf"],
                    "routed_experts": base64.b64encode(smp.routed_experts).decode()
                    if smp.routed_experts
                    else None,
                    "mismatch": types,
                }
            )
        return web.json_response({"session_id": s.id, "samples": out})

    def _mismatch(self, tree: TokenTree, leaf: Node) -> list[str]:
        """tito_session_mismatch of one trajectory (metric only; never changes the row)."""
        try:
            expected = self.family.encode_messages(
                tree.messages(leaf), add_generation_prompt=False, tools=tree.tools
            )
        except ValueError as exc:
            raise SessionError(f"canonical render failed for leaf {leaf.id}: {exc}", 500) from exc
        types = classify(expected, closed_row(tree.row(leaf), self.family), self.family)
        self.metrics.checks.inc()
        for t in types:
            self.metrics.mismatch.labels(t).inc()
        return types


def _completion(
    sid: str, node: Node, reply: Message, prompt: int, cached: int, created: int
) -> dict[str, Any]:
    """The OpenAI chat.completion object for one turn."""
    calls = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in reply.tool_calls
    ]
    finish = "tool_calls" if calls else ("length" if node.finish_reason == "length" else "stop")
    message: dict[str, Any] = {
        "role": "assistant",
        "content": reply.content if reply.content or not calls else None,
    }
    if calls:
        message["tool_calls"] = calls
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    n_out = node.output_len
    return {
        "id": f"chatcmpl-{sid[:12]}-{node.id}",
        "object": "chat.completion",
        "created": created,
        "model": "lockstep-session",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": n_out,
            "total_tokens": prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }
