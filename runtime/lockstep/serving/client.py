"""EngineClient: the one asyncio client for SGLang servers and our reference engine.

Why it exists: the rollout code, the weight transports and the driver call a rollout engine through
this class only, so a real SGLang server and `lockstep engine` are interchangeable. Connection
failures are retried with exponential backoff, then raise `EngineUnreachable` naming the URL; an
HTTP error status raises `EngineError` with the server's message; a connection that breaks after the
request was sent raises `NoReply` (not retried: the engine may have run it). The HTTP layer is
lockstep.serving.http (aiohttp, pooled keep-alive connections).

Per-token weight versions (GenerateResult.token_versions): SGLang (and the reference engine) report
them as meta_info.weight_versions spans {version, start, end}; the client expands them per token (a
version that is not an integer is None). A server that sends no spans gets an honest derivation:
versions only grow, so if the last version this client saw before submitting equals the version
reported with the reply, every token was sampled by that version; otherwise they are unknown (None).
The coverage metric (weight_version_sample_coverage) counts the tokens with a known version.

Who calls it: lockstep.rollout (generate), lockstep.weights (update endpoints), lockstep.driver
(pause/continue, health).
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from lockstep.api.auth import API_KEY_ENV as API_KEY_ENV  # re-exported for the servers' CLIs
from lockstep.api.auth import api_key_from_env as api_key_from_env
from lockstep.api.auth import auth_headers
from lockstep.serving.context_fit import fit_request
from lockstep.serving.http import ConnectFailed, JsonHttp, NoReply, Reply
from lockstep.serving.payloads import (
    ROUTES,
    AbortRequest,
    CheckAction,
    CheckWeightsReply,
    CheckWeightsRequest,
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    DetokenizeReply,
    DetokenizeRequest,
    GenerateReply,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoraAdapterFromTensorsRequest,
    LoadLoraAdapterRequest,
    LoraUpdateReply,
    ModelInfoReply,
    ModelListReply,
    PauseGenerationRequest,
    SamplingParams,
    SuccessReply,
    UnloadLoraAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    WeightVersionSpan,
)
from lockstep.serving.scoring import ScoredRow, parse_scores, score_request

_R = TypeVar("_R", bound=BaseModel)


class EngineError(RuntimeError):
    """The engine answered with an error status (bad request, failed update, ...)."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.url = url
        """The full URL that failed."""
        self.status = status
        """The HTTP status code."""
        self.message = message
        """The server's message."""


class EngineUnreachable(ConnectionError):
    """No connection to the engine after all retries; the message names the URL and the fix."""

    def __init__(self, url: str, attempts: int, cause: BaseException) -> None:
        super().__init__(
            f"rollout engine at {url} unreachable after {attempts} attempts ({type(cause).__name__}: {cause}); "
            "check that the engine is running and the URL (host, port) is right"
        )
        self.url = url
        """The URL that could not be reached."""
        self.attempts = attempts
        """How many connection attempts were made."""


@dataclass(slots=True)
class GenerateResult:
    """One sample's reply from /generate, typed for the rollout code.

    All per-token lists have length R = len(output_ids).
    """

    output_ids: list[int]
    """Sampled token IDs (the stop token included when one matched)."""
    output_logprobs: list[float]
    """Logprob of each sampled token under the engine's sampling distribution (empty without return_logprob)."""
    finish_reason: str
    """stop | length | abort."""
    weight_version: int | None
    """The engine's version reported with the reply (None if not an integer)."""
    token_versions: list[int | None]
    """Version that sampled each token; None where unknown (see module doc)."""
    prompt_tokens: int
    """Prompt length in tokens."""
    cached_tokens: int
    """Prompt tokens served from the prefix cache."""
    routed_experts: bytes | None = None
    """R3 routing data (int32 [tokens-1, layers, topk]) when requested, else None."""
    text: str = ""
    """Decoded output (informational; the runtime trains on IDs)."""
    rid: str = ""
    """The request ID."""
    input_logprobs: list[float | None] | None = None
    """Prompt-token logprobs from logprob_start_len when asked (first may be None), else None."""
    matched_stop: int | str | None = None
    """The stop token or string that ended the sample."""
    abort_message: str | None = None
    """Why the engine aborted the request."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Unparsed meta_info fields, for debugging."""


class GenerateBackend(Protocol):
    """The swap point the rollout code depends on: anything that samples like EngineClient.generate."""

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        return_logprob: bool = True,
        logprob_start_len: int = -1,
        return_routed_experts: bool = False,
        rid: str | None = None,
        lora_path: str | None = None,
    ) -> GenerateResult: ...


def _parse_version(v: str | int | None) -> int | None:
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def span_versions(spans: Sequence[WeightVersionSpan], n: int) -> list[int | None]:
    """Per-token versions of `n` output tokens from SGLang's spans (pure); raises ValueError when the
    spans do not tile [0, n) in order."""
    versions: list[int | None] = []
    for span in spans:
        if span.start != len(versions) or span.end < span.start:
            raise ValueError(
                f"weight_versions span {span.start}..{span.end} does not follow token {len(versions)}"
            )
        versions += [_parse_version(span.version)] * (span.end - span.start)
    if len(versions) != n:
        raise ValueError(f"engine returned weight_versions spans over {len(versions)} tokens for {n} tokens")
    return versions


def result_from_reply(reply: GenerateReply, submit_version: int | None) -> GenerateResult:
    """Pure: a parsed /generate reply (+ the last version seen before submit) -> GenerateResult."""
    meta = reply.meta_info
    n = len(reply.output_ids)
    logprobs = [float(t[0]) for t in meta.output_token_logprobs] if meta.output_token_logprobs else []
    if logprobs and len(logprobs) != n:
        raise ValueError(f"engine returned {len(logprobs)} output_token_logprobs for {n} output_ids")
    version = _parse_version(meta.weight_version)
    versions: list[int | None]
    if meta.weight_versions is not None:
        versions = span_versions(meta.weight_versions, n)
    elif version is not None and submit_version == version:
        versions = [version] * n
    else:
        versions = [None] * n
    fr = meta.finish_reason
    input_lp = None
    if meta.input_token_logprobs is not None:
        input_lp = [None if t[0] is None else float(t[0]) for t in meta.input_token_logprobs]
    return GenerateResult(
        output_ids=list(reply.output_ids),
        output_logprobs=logprobs,
        finish_reason=fr.type if fr else "abort",
        weight_version=version,
        token_versions=versions,
        prompt_tokens=meta.prompt_tokens,
        cached_tokens=meta.cached_tokens,
        routed_experts=base64.b64decode(meta.routed_experts) if meta.routed_experts else None,
        text=reply.text,
        rid=meta.id,
        input_logprobs=input_lp,
        matched_stop=fr.matched if fr else None,
        abort_message=fr.message if fr and fr.type == "abort" else None,
    )


class EngineClient:
    """Async client of one engine (SGLang or ours). Use as `async with EngineClient(url) as c:`.

    retries: connection attempts per call (>= 1); backoff_s: first wait, doubled each retry up to
    max_backoff_s. `sleep` is injectable so tests need not wait. api_key: sent as a bearer token on
    every call (default: LOCKSTEP_API_KEY, see auth_headers). Only connection failures are retried
    (never a request the server may have executed twice, except idempotent reads).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        retries: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        api_key: str | None = None,
    ) -> None:
        if retries < 1:
            raise ValueError(f"retries={retries}: must be >= 1 (1 means no retry)")
        self.base_url = base_url.rstrip("/")
        """Engine URL, e.g. http://127.0.0.1:30000."""
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._sleep = sleep
        self.last_version: int | None = None
        """The latest weight version this client saw (replies, updates, model_info)."""
        self._http = JsonHttp(timeout_s=timeout_s, headers=auth_headers(api_key))
        self._context: int | None = None
        self._context_known = False

    @property
    def closed(self) -> bool:
        """True after aclose()."""
        return self._http.closed

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- transport -----------------------------------------------------------------------------

    async def _request(
        self,
        endpoint: str,
        body: BaseModel | None = None,
        *,
        ok: tuple[int, ...] = (),
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        method, path = ROUTES[endpoint]
        payload = body.model_dump(mode="json", exclude_none=True) if body is not None else None
        return await self._send(method, path, payload, ok=ok, headers=headers)

    async def _send(
        self,
        method: str,
        path: str,
        payload: Any,
        *,
        ok: tuple[int, ...] = (),
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        """`ok`: error statuses returned to the caller instead of raised (their body is the answer).

        Raises EngineUnreachable when no connection could be made after the retries, NoReply when the
        connection broke (or timed out) after the request was sent: never retried, it may have run."""
        url = self.base_url + path
        delay = self.backoff_s
        last: BaseException | None = None
        for attempt in range(1, self.retries + 1):
            try:
                resp = await self._http.request(method, url, payload, headers=headers)
            except ConnectFailed as e:
                last = e
                if attempt < self.retries:
                    await self._sleep(delay)
                    delay = min(delay * 2, self.max_backoff_s)
                continue
            if resp.status_code >= 400 and resp.status_code not in ok:
                raise EngineError(url, resp.status_code, _error_text(resp))
            return resp
        assert last is not None
        raise EngineUnreachable(url, self.retries, last)

    async def _call(self, endpoint: str, body: BaseModel | None, reply: type[_R]) -> _R:
        resp = await self._request(endpoint, body)
        return reply.model_validate(resp.json())

    def _saw_version(self, v: str | int | None) -> None:
        parsed = _parse_version(v)
        if parsed is not None:
            self.last_version = parsed

    # -- generation ----------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        return_logprob: bool = True,
        logprob_start_len: int = -1,
        return_routed_experts: bool = False,
        rid: str | None = None,
        routed_dp_rank: int | None = None,
        headers: Mapping[str, str] | None = None,
        lora_path: str | None = None,
    ) -> GenerateResult:
        """Sample one continuation of `input_ids` (token in, token out).

        routed_dp_rank pins the request to one DP-attention rank; headers go with the request (e.g.
        sgl-router's routing key); lora_path names the loaded LoRA adapter to sample with.
        max_new_tokens is lowered to what the engine's context leaves (lockstep.serving.context_fit);
        raises ContextFull when the input alone fills it.
        """
        # ask only for what fits: stock SGLang refuses a request beyond its context (400)
        params = fit_request(input_ids, sampling_params or SamplingParams(), await self.context_length())
        req = GenerateRequest(
            input_ids=list(input_ids),
            sampling_params=params,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            return_routed_experts=return_routed_experts,
            rid=rid or uuid.uuid4().hex,
            routed_dp_rank=routed_dp_rank,
            lora_path=lora_path,
        )
        submit_version = self.last_version
        resp = await self._request("generate", req, headers=headers)
        reply = GenerateReply.model_validate(resp.json())
        self._saw_version(reply.meta_info.weight_version)
        return result_from_reply(reply, submit_version)

    async def context_length(self) -> int | None:
        """The engine's context length (GET /v1/models, `max_model_len` of the base's card), asked once;
        None when the engine does not serve the route (then requests go out as they are)."""
        if self._context_known:
            return self._context
        method, path = ROUTES["models"]
        try:  # one attempt: an engine that is not up yet is named by the request that follows
            resp = await self._http.request(method, self.base_url + path, None)
        except (ConnectFailed, NoReply):
            return None  # asked again next time
        if resp.status_code >= 400 and resp.status_code not in (404, 405):
            return None  # not serving yet (503) or refused: asked again next time
        if resp.status_code < 400:
            try:
                cards = ModelListReply.model_validate(resp.json()).data
            except (ValidationError, ValueError):  # not SGLang's model list: the context stays unknown
                cards = []
            base = [c for c in cards if c.parent is None]  # adapters' cards carry no context length
            self._context = base[0].max_model_len if base else None
        self._context_known = True
        return self._context

    async def score(
        self,
        ids: Sequence[int],
        start: int,
        *,
        top_k: int = 0,
        token_ids: Sequence[int] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> ScoredRow:
        """Score the exact IDs `ids` from position `start` without sampling (lockstep.serving.scoring):
        each token's logprob, and with top_k / token_ids the most likely tokens and the listed IDs'
        logprobs at every position. Raises ValueError when the reply scores other IDs."""
        req = score_request(ids, start, top_k=top_k, token_ids=token_ids)
        resp = await self._request("generate", req, headers=headers)
        reply = GenerateReply.model_validate(resp.json())
        return parse_scores(
            reply, ids, start, top_k=top_k, token_ids=bool(token_ids), reply_bytes=len(resp.body)
        )

    async def detokenize(self, token_lists: Sequence[Sequence[int]]) -> list[str]:
        """Decode each ID list to one string with the server's tokenizer, special tokens included
        (SGLang's /v1/detokenize)."""
        body = DetokenizeRequest(tokens=[list(t) for t in token_lists], skip_special_tokens=False)
        reply = await self._call("detokenize", body, DetokenizeReply)
        texts = [reply.text] if isinstance(reply.text, str) else list(reply.text)
        if len(texts) != len(token_lists):
            raise ValueError(f"/v1/detokenize returned {len(texts)} texts for {len(token_lists)} ID lists")
        return texts

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request by rid, or all requests when rid is None."""
        await self._request("abort_request", AbortRequest(rid=rid or "", abort_all=rid is None))

    # -- health and cache ----------------------------------------------------------------------

    async def health(self) -> bool:
        """True when the server answers /health with 200 (no retries: a probe)."""
        try:
            resp = await self._http.request("GET", self.base_url + ROUTES["health"][1])
        except (ConnectFailed, NoReply):
            return False
        return resp.status_code == 200

    async def health_generate(self) -> None:
        """Raises unless the server can run a one-token generation."""
        await self._request("health_generate")

    async def wait_ready(self, timeout_s: float = 120.0, poll_s: float = 0.5) -> None:
        """Poll /health until 200; raises EngineUnreachable after about timeout_s of polling."""
        attempts = max(1, int(timeout_s / poll_s))
        for _ in range(attempts):
            if await self.health():
                return
            await self._sleep(poll_s)
        raise EngineUnreachable(self.base_url + "/health", attempts, TimeoutError("no 200 from /health"))

    async def flush_cache(self) -> None:
        await self._request("flush_cache")

    async def pause_generation(self, mode: str = "retract") -> None:
        """Pause sampling: abort | retract (held, resumed after continue) | in_place (keeps KV)."""
        await self._request("pause_generation", PauseGenerationRequest.model_validate({"mode": mode}))

    async def continue_generation(self) -> None:
        await self._request("continue_generation", ContinueGenerationRequest())

    # -- weights -------------------------------------------------------------------------------

    async def _update(self, endpoint: str, body: BaseModel, version: str | None) -> SuccessReply:
        reply = await self._call(endpoint, body, SuccessReply)
        if not reply.success:
            raise EngineError(self.base_url + ROUTES[endpoint][1], 200, reply.message)
        if version is not None:
            self._saw_version(version)
        return reply

    async def update_weights_from_disk(
        self, model_path: str, *, weight_version: int | str | None = None, flush_cache: bool = True
    ) -> SuccessReply:
        v = None if weight_version is None else str(weight_version)
        body = UpdateWeightsFromDiskRequest(model_path=model_path, weight_version=v, flush_cache=flush_cache)
        return await self._update("update_weights_from_disk", body, v)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> SuccessReply:
        body = InitWeightsUpdateGroupRequest(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        return await self._update("init_weights_update_group", body, None)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> SuccessReply:
        return await self._update(
            "destroy_weights_update_group", DestroyWeightsUpdateGroupRequest(group_name=group_name), None
        )

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: int | str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> SuccessReply:
        """Tell the engine to receive broadcasts of these tensors; the caller broadcasts concurrently.

        load_format None: one broadcast per tensor; "flattened_bucket": one uint8 broadcast of the
        tensors' bytes back to back, in the order named (SGLang's FlattenedTensorBucket layout).
        """
        v = None if weight_version is None else str(weight_version)
        body = UpdateWeightsFromDistributedRequest(
            names=list(names),
            dtypes=list(dtypes),
            shapes=[list(s) for s in shapes],
            group_name=group_name,
            weight_version=v,
            flush_cache=flush_cache,
            load_format=load_format,
        )
        return await self._update("update_weights_from_distributed", body, v)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        weight_version: int | str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
    ) -> SuccessReply:
        v = None if weight_version is None else str(weight_version)
        body = UpdateWeightsFromTensorRequest(
            serialized_named_tensors=list(serialized_named_tensors),
            weight_version=v,
            load_format=load_format,
            flush_cache=flush_cache,
        )
        return await self._update("update_weights_from_tensor", body, v)

    async def update_weight_version(self, version: int | str, *, abort_all_requests: bool = False) -> None:
        body = UpdateWeightVersionRequest(new_version=str(version), abort_all_requests=abort_all_requests)
        await self._request("update_weight_version", body)
        self._saw_version(str(version))

    # -- LoRA adapters (SGLang's --enable-lora routes) ------------------------------------------

    async def _lora(self, endpoint: str, body: BaseModel) -> LoraUpdateReply:
        resp = await self._request(endpoint, body, ok=(400,))
        reply = LoraUpdateReply.model_validate(resp.json())
        if not reply.success:
            raise EngineError(
                self.base_url + ROUTES[endpoint][1], resp.status_code, reply.error_message or ""
            )
        return reply

    async def load_lora_adapter(self, name: str, path: str, *, pinned: bool = False) -> LoraUpdateReply:
        """Load the adapter directory `path` (peft layout, as the engine sees it) under `name`."""
        body = LoadLoraAdapterRequest(lora_name=name, lora_path=path, pinned=pinned)
        return await self._lora("load_lora_adapter", body)

    async def load_lora_adapter_from_tensors(
        self,
        name: str,
        config: Mapping[str, Any],
        payload: str,
        *,
        expected_checksums: Mapping[str, str] | None = None,
        pinned: bool = False,
    ) -> LoraUpdateReply:
        """Load an adapter sent in the request: `payload` is base64 of a pickled {name: tensor} dict
        (lockstep.serving.tensor_codec), `config` its peft adapter_config; with expected_checksums the
        engine checks every tensor's sha256 before it loads."""
        body = LoadLoraAdapterFromTensorsRequest(
            lora_name=name,
            config_dict=dict(config),
            serialized_named_tensors=[payload],
            pinned=pinned,
            expected_checksums=dict(expected_checksums) if expected_checksums is not None else None,
        )
        return await self._lora("load_lora_adapter_from_tensors", body)

    async def unload_lora_adapter(self, name: str) -> LoraUpdateReply:
        """Unload adapter `name` once the requests using it have finished."""
        return await self._lora("unload_lora_adapter", UnloadLoraAdapterRequest(lora_name=name))

    async def list_models(self) -> ModelListReply:
        """GET /v1/models: the served base and every loaded LoRA adapter (`.adapters()`)."""
        return await self._call("models", None, ModelListReply)

    async def model_info(self) -> ModelInfoReply:
        info = await self._call("model_info", None, ModelInfoReply)
        self._saw_version(info.weight_version)
        return info

    async def get_weight_version(self) -> int | None:
        """The engine's current version, from /model_info."""
        info = await self.model_info()
        return _parse_version(info.weight_version)

    async def check_weights(
        self,
        action: CheckAction,
        *,
        skip_tensor_list: Sequence[str] | None = None,
        allow_quant_error: bool = False,
    ) -> CheckWeightsReply:
        """POST /weights_checker: snapshot, reset_tensors, compare or checksum the engine's weights.

        Returns the reply also when the engine says success=false (HTTP 400, whose message names every
        differing tensor of a failed compare), so the pre-flight can report them.
        """
        body = CheckWeightsRequest(
            action=action,
            allow_quant_error=allow_quant_error,
            skip_tensor_list=list(skip_tensor_list) if skip_tensor_list is not None else None,
        )
        resp = await self._request("weights_checker", body, ok=(400,))
        return CheckWeightsReply.model_validate(resp.json())


def _error_text(resp: Reply) -> str:
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(data, dict):
        for key in ("message", "error", "detail"):
            if key in data:
                return str(data[key])[:500]
    return str(data)[:500]
