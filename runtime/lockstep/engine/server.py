"""The SGLang HTTP API subset, served by aiohttp in front of a ReferenceEngine.

Why it exists: the runtime's EngineClient speaks SGLang's HTTP API; this module serves the same
routes and bodies (lockstep.serving.payloads) so `lockstep engine` can stand in for an SGLang server.
Per-token weight versions go out as SGLang's own meta_info.weight_versions spans. Extensions beyond
stock SGLang are explicit: GET /engine_stats (prefix-cache hit rate and counters) and the P2P receive
side (lockstep.engine.ext_weights). With stock=True neither is served, so a test can run the runtime
against exactly what stock SGLang offers (runtime/tests/sglang/ walks the routes against the pinned
SGLang's source). POST /weights_checker (the pre-flight) is SGLang's: lockstep.engine.weights_checker.

Errors: a request body that does not validate, or asks for something this engine does not do, gets
HTTP 400 with {"error": ...} naming the field; weight endpoints answer SGLang's {success, message}
(400 on failure). /update_weights_from_tensor unpickles tensors, so it answers 403 unless the app
was created with allow_tensor_updates=True (and then allows only torch's tensor rebuild functions).

Weight updates over a group (/update_weights_from_distributed) are checked against the model first and
received straight into the live parameters (see `_receive`): no per-update allocation or copy unless a
tensor's dtype differs from its parameter's.

Who calls it: lockstep.cli.engine (serves it), tests (real server on 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import base64
import collections.abc as cabc
import importlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from lockstep.engine import lora_routes, weights_checker
from lockstep.engine.core import EngineBusy, EngineInputError, ReferenceEngine, Sequence
from lockstep.engine.disk_reads import DISK_READ_TIMEOUT_S, DiskPolicy, DiskRefused, read_checkpoint
from lockstep.engine.metrics import sglang_registry
from lockstep.engine.update_sizes import check_size_preamble
from lockstep.rollout.session.affinity import ROUTING_HEADER
from lockstep.serving.guard import bearer_middleware, parse_json
from lockstep.serving.payloads import (
    AbortRequest,
    DestroyWeightsUpdateGroupRequest,
    DetokenizeRequest,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    SamplingParams,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
)
from lockstep.serving.tensor_codec import loads_named_tensors
from lockstep.serving.weight_group import on_the_wire, open_weight_update_group

log = logging.getLogger(__name__)

ENGINE_KEY = web.AppKey("engine", ReferenceEngine)
"""Where handlers (ours and ext_weights') find the engine: app[ENGINE_KEY]."""
_ALLOW_TENSOR_KEY = web.AppKey("allow_tensor_updates", bool)
_IPC_HELD_KEY = web.AppKey("ipc_held", list)
"""The tensors of the update in progress mapped from /update_weights_from_tensor payloads."""
_DISK_POLICY_KEY = web.AppKey("disk_policy", DiskPolicy)
_EXT_MODULE = "lockstep.engine.ext_weights"


def _bad(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _parse(request: web.Request, model: type[BaseModel]) -> Any:
    """Body -> pydantic model; raises web.HTTPBadRequest naming the bad field."""
    try:
        return model.model_validate(parse_json(await request.read()))
    except (ValidationError, ValueError) as e:
        raise web.HTTPBadRequest(
            text=json.dumps({"error": f"{request.path}: invalid body: {e}"}), content_type="application/json"
        ) from e


def _result(success: bool, message: str, **extra: Any) -> web.Response:
    return web.json_response(
        {"success": success, "message": message, **extra}, status=200 if success else 400
    )


# -- generation ------------------------------------------------------------------------------


def _unsupported(req: GenerateRequest, engine: ReferenceEngine) -> str | None:
    if req.stream:
        return "stream=true is not supported by the reference engine"
    if req.return_routed_experts and not engine.is_moe:
        return "return_routed_experts: this is a dense model, there are no routed experts"
    if req.routed_dp_rank not in (None, 0):
        return (
            f"routed_dp_rank={req.routed_dp_rank}: the reference engine has a single DP rank; "
            "send 0 or leave it out"
        )
    return None


def _spans(versions: list[int], current: int) -> list[dict[str, Any]]:
    """SGLang's meta_info.weight_versions: one {version, start, end} per run of equal token versions
    (a reply without output tokens gets one empty span of the current version, as SGLang's)."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans or [{"version": str(current), "start": 0, "end": 0}]


def _reply(engine: ReferenceEngine, seq: Sequence, req: GenerateRequest) -> dict[str, Any]:
    out = seq.output_ids
    text = ""
    skip = seq.params.skip_special_tokens
    if engine.tokenizer is not None:
        text = engine.tokenizer.decode(out, skip_special_tokens=skip)
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": seq.finish,
        "prompt_tokens": seq.prompt_len,
        "completion_tokens": len(out),
        "cached_tokens": max(seq.cached_tokens, 0),
        "weight_version": str(engine.weight_version),
        "e2e_latency": time.monotonic() - seq.created,
        "weight_versions": _spans(seq.versions, engine.weight_version),
    }
    if req.return_logprob:
        dec = engine.tokenizer.decode if (engine.tokenizer and req.return_text_in_logprobs) else None
        meta["output_token_logprobs"] = [
            [lp, tok, dec([tok]) if dec else None] for lp, tok in zip(seq.logprobs, out, strict=True)
        ]
        scores = seq.input_scores
        if scores is not None:
            ids = seq.tokens[seq.input_logprob_start : seq.prompt_len]
            meta["input_token_logprobs"] = [
                [lp, tok, dec([tok]) if dec else None] for lp, tok in zip(scores.chosen, ids, strict=True)
            ]
            if scores.top is not None:  # SGLang writes these keys only when they were asked for
                meta["input_top_logprobs"] = _triples(scores.top, dec)
            if scores.token_ids is not None:
                meta["input_token_ids_logprobs"] = _triples(scores.token_ids, dec)
    if req.return_routed_experts and seq.routed_experts is not None:
        # SGLang's format: base64 of the int32 [prompt + output - 1, layers, top-k] array's bytes.
        meta["routed_experts"] = base64.b64encode(seq.routed_experts).decode("ascii")
    return {"text": text, "output_ids": out, "meta_info": meta}


def _triples(
    rows: list[list[tuple[float, int]] | None], dec: Callable[[list[int]], str] | None
) -> list[list[list[Any]] | None]:
    """Per position: None, or SGLang's [logprob, token_id, text-or-null] per candidate."""
    return [
        None if row is None else [[lp, tok, dec([tok]) if dec else None] for lp, tok in row] for row in rows
    ]


async def generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    req: GenerateRequest = await _parse(request, GenerateRequest)
    problem = _unsupported(req, engine)
    if problem:
        return _bad(problem)
    batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
    prompts: list[list[int]] = req.input_ids if batch else [req.input_ids]  # type: ignore[assignment,list-item]
    params = (
        req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params] * len(prompts)
    )
    rids = req.rid if isinstance(req.rid, list) else [req.rid] * len(prompts)
    if len(params) != len(prompts) or len(rids) != len(prompts):
        return _bad("sampling_params and rid lists must have one entry per prompt of input_ids")
    if batch and isinstance(req.rid, str):
        rids = [f"{req.rid}-{i}" for i in range(len(prompts))]
    if len(prompts) > engine.max_queued_requests:
        return _bad(
            f"input_ids holds {len(prompts)} prompts; this engine queues at most "
            f"{engine.max_queued_requests} (send smaller batches)"
        )
    try:
        seqs = [
            engine.new_sequence(
                p,
                sp,
                rid=r,
                logprob_start_len=req.logprob_start_len,
                return_routed_experts=req.return_routed_experts,
                top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
                token_ids_logprob=req.token_ids_logprob if req.return_logprob else None,
                adapter=req.lora_path,
            )
            for p, sp, r in zip(prompts, params, rids, strict=True)
        ]
        done = await engine.submit_many(seqs)  # the whole batch or none of it (503 when full)
    except EngineInputError as e:
        return _bad(str(e))
    if key := request.headers.get(ROUTING_HEADER):  # a session server's turn: which session it was
        engine.stats.count_turn(key)
    replies = [_reply(engine, s, req) for s in done]
    return web.json_response(replies if batch else replies[0])


async def detokenize(request: web.Request) -> web.Response:
    """SGLang's /v1/detokenize (and /detokenize): one ID list -> one text, a list of lists -> a text each."""
    engine = request.app[ENGINE_KEY]
    body: DetokenizeRequest = await _parse(request, DetokenizeRequest)
    if engine.tokenizer is None:
        return _bad("this engine was started without a tokenizer; it cannot detokenize")
    lists = body.tokens if body.tokens and isinstance(body.tokens[0], list) else [body.tokens]
    for ids in lists:
        bad = next((t for t in ids if not 0 <= int(t) < engine.vocab_size), None)  # type: ignore[arg-type]
        if bad is not None:
            return _bad(f"tokens contains {bad}, outside the vocabulary [0, {engine.vocab_size})")
    skip = body.skip_special_tokens
    texts = [engine.tokenizer.decode(list(ids), skip_special_tokens=skip) for ids in lists]  # type: ignore[arg-type]
    if not body.tokens:
        return web.json_response({"text": ""})
    return web.json_response({"text": texts if isinstance(body.tokens[0], list) else texts[0]})


async def abort_request(request: web.Request) -> web.Response:
    body: AbortRequest = await _parse(request, AbortRequest)
    await request.app[ENGINE_KEY].abort(None if body.abort_all else body.rid)
    return web.Response(status=200)


def serving(app: web.Application) -> bool:
    """What /health answers 200 to (also the engine's `lockstep_engine_ready` series)."""
    return app[_JOIN_KEY].get("join") is None and not app[ENGINE_KEY].draining


async def health(request: web.Request) -> web.Response:
    """200 when serving; 503 while a weight-group join runs (the engine is not ready for an update
    or a rollout on the new policy until it ends) or while draining for shutdown."""
    join = request.app[_JOIN_KEY].get("join")
    if join is not None:
        return web.Response(status=503, text=f"joining weight update group {join.name!r}")
    if request.app[ENGINE_KEY].draining:
        return web.Response(status=503, text="shutting down")
    return web.Response(status=200)


async def health_generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if engine.is_paused:  # paused on purpose (a weight update): alive, and a probe must not wait
        return web.Response(status=200, text="paused")
    seq = engine.new_sequence([0], SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    done = await engine.submit(seq)
    if done.finish is None or done.finish.get("type") == "abort":
        return web.Response(status=503, text="generation failed")
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    n = request.app[ENGINE_KEY].flush_cache()
    return web.Response(status=200, text=f"Cache flushed ({n} cached slots dropped).\n")


async def pause_generation(request: web.Request) -> web.Response:
    body: PauseGenerationRequest = await _parse(request, PauseGenerationRequest)
    await request.app[ENGINE_KEY].pause(body.mode)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    await request.app[ENGINE_KEY].resume()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


# -- weights ---------------------------------------------------------------------------------


_UpdateBody = (
    UpdateWeightsFromDiskRequest | UpdateWeightsFromDistributedRequest | UpdateWeightsFromTensorRequest
)
_Staged = list[tuple[torch.Tensor, torch.Tensor]]


class UpdateRefused(Exception):
    """A weight update failed before its swap: the served weights and version are the old ones."""


async def _install(engine: ReferenceEngine, body: _UpdateBody, stage: Callable[[], _Staged]) -> int:
    """The transaction every weight endpoint runs: validate, stage, then swap.

    1. the version is checked (an integer in [0, 2**63); see ReferenceEngine.check_version) before
       anything moves;
    2. under the step lock, `stage` runs on the worker thread: it reads or receives every tensor and
       checks it against the model into staging buffers; the live weights are not touched;
    3. only when every tensor is staged are they copied into the parameters, the prefix cache is
       flushed (its KV came from the old weights) and the version is set, last.
    Any failure in 1-2 raises UpdateRefused: weights, version and cache are exactly the old ones.
    abort_all_requests aborts only once the version passed. Returns the tensor count.
    """
    try:
        version = engine.check_version(body.weight_version, new_weights=True)
    except EngineInputError as e:
        raise UpdateRefused(str(e)) from e
    if body.abort_all_requests:
        await engine.abort(None, message="aborted for a weight update")
    async with engine.exclusive():
        try:
            staged = await engine.run_in_worker(stage)
        except Exception as e:  # any failure before the swap is reported, never half-applied
            raise UpdateRefused(f"{type(e).__name__}: {e}") from e
        n: int = await engine.run_in_worker(engine.commit_weights, staged)
        engine.flush_cache()
        if version is not None:
            engine.set_weight_version(version, new_weights=True)
    return n


def _refused(what: str, engine: ReferenceEngine, e: Exception) -> web.Response:
    return _result(
        False,
        f"{what} failed: {e}; the served weights and weight_version {engine.weight_version} are unchanged",
        weight_version=str(engine.weight_version),
    )


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body: UpdateWeightsFromDiskRequest = await _parse(request, UpdateWeightsFromDiskRequest)
    try:
        engine.check_version(body.weight_version, new_weights=True)  # refused before any read
        # read before the step lock, on a thread of its own: generation and /health go on meanwhile
        named = await read_checkpoint(body.model_path, request.app[_DISK_POLICY_KEY])
    except (EngineInputError, DiskRefused, TimeoutError, OSError) as e:
        return _refused("update_weights_from_disk", engine, e)
    try:
        n = await _install(engine, body, lambda: engine.stage_weights(named, cast=True, owned=True))
    except UpdateRefused as e:
        return _refused("update_weights_from_disk", engine, e)
    return _result(True, f"Loaded {n} tensors from {body.model_path}.", num_paused_requests=0)


@dataclass(slots=True)
class _Join:
    """A weight-group join in flight (the engine is not ready while one runs)."""

    name: str
    """group_name being joined."""
    cancelled: bool = False
    """Set by /destroy_weights_update_group or shutdown: the group is closed as soon as it forms."""


_JOIN_KEY = web.AppKey("weight_group_join", dict)
"""app[_JOIN_KEY]["join"]: the _Join in flight, if any."""
_JOIN_TIMEOUT_KEY = web.AppKey("weight_group_join_timeout_s", float)


def _off_loop(
    fn: Callable[[], Any], on_done: Callable[[Any, BaseException | None], None]
) -> asyncio.Future[Any]:
    """Run a blocking call that cannot be interrupted (a rendezvous) on a daemon thread of its own:
    generation steps keep running on the engine's worker, and shutdown never waits for it.
    `on_done(result, error)` runs on the event loop when it ends, even if nobody awaits the future;
    if the loop is gone by then, it runs on that thread."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def finish(result: Any, error: BaseException | None) -> None:
        on_done(result, error)
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as e:  # reported through the future
            error = e
        try:
            loop.call_soon_threadsafe(finish, result, error)
        except RuntimeError:  # the loop closed (shutdown): nobody will take the group
            on_done(result, error)

    threading.Thread(target=run, name="lockstep-weight-group-join", daemon=True).start()
    return fut


async def init_weights_update_group(request: web.Request) -> web.Response:
    """Join the trainer's weight-update group without stalling generation: the rendezvous runs on a
    thread of its own, bounded by the join timeout (--weight-group-timeout); /health answers 503 while
    it runs; /destroy_weights_update_group cancels it."""
    engine = request.app[ENGINE_KEY]
    body: InitWeightsUpdateGroupRequest = await _parse(request, InitWeightsUpdateGroupRequest)
    joins = request.app[_JOIN_KEY]
    if engine.weight_group is not None:
        return _result(False, f"group {engine.weight_group.name!r} already open; destroy it first")
    if joins.get("join") is not None:
        return _result(False, f"group {joins['join'].name!r} is being joined; wait, or destroy it first")
    timeout = request.app[_JOIN_TIMEOUT_KEY]
    join = _Join(body.group_name)
    joins["join"] = join

    def joined(group: Any, error: BaseException | None) -> None:
        if joins.get("join") is join:
            joins["join"] = None
        if group is None:
            return
        if join.cancelled or engine.weight_group is not None:
            group.close()
        else:
            engine.weight_group = group

    fut = _off_loop(
        lambda: open_weight_update_group(
            backend=body.backend,
            master_address=body.master_address,
            master_port=body.master_port,
            rank=body.rank_offset,  # the engine is a single rank: tp rank 0 -> global rank rank_offset
            world_size=body.world_size,
            group_name=body.group_name,
            join_timeout_s=timeout,
            announce_sizes=True,  # checked before any data collective, when the sender sends it too
        ),
        joined,
    )
    try:
        await asyncio.wait_for(asyncio.shield(fut), timeout + 5.0)
    except TimeoutError:  # the thread may outlive the reply (torch retries past its timeout): let go of it
        join.cancelled = True
        if joins.get("join") is join:
            joins["join"] = None  # ready again now, not when the abandoned rendezvous gives up
        return _result(False, f"init_weights_update_group: no rendezvous within {timeout:.0f} s")
    except Exception as e:  # the rendezvous failed: the caller's address, port or world size
        return _result(False, f"init_weights_update_group failed: {type(e).__name__}: {e}")
    if join.cancelled:
        return _result(False, "init_weights_update_group: cancelled by /destroy_weights_update_group")
    return _result(True, "Succeeded to initialize custom process group.")


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body: DestroyWeightsUpdateGroupRequest = await _parse(request, DestroyWeightsUpdateGroupRequest)
    join = request.app[_JOIN_KEY].get("join")
    if join is not None and join.name == body.group_name:
        join.cancelled = True
        request.app[_JOIN_KEY]["join"] = None
        return _result(True, f"Cancelled the join of group {body.group_name!r}.")
    group = engine.weight_group
    if group is None or group.name != body.group_name:
        return _result(False, f"no open weight update group named {body.group_name!r}")
    engine.weight_group = None
    async with engine.exclusive():  # no update is receiving on it
        await engine.run_in_worker(group.close)
    return _result(True, "Succeeded to destroy custom process group.")


_Spec = tuple[str, torch.dtype, tuple[int, ...]]
_FLATTENED = "flattened_bucket"
"""SGLang's load_format for one broadcast per bucket (FlattenedTensorBucket's byte layout)."""


def _specs(body: UpdateWeightsFromDistributedRequest) -> list[_Spec]:
    """(name, dtype, shape) per announced tensor; a dtype torch does not know is the caller's error."""
    specs = []
    for name, dtype, shape in zip(body.names, body.dtypes, body.shapes, strict=True):
        dt = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"dtypes: {dtype!r} (for {name}) is not a torch dtype (e.g. bfloat16, float32)")
        specs.append((name, dt, tuple(shape)))
    return specs


def _nbytes(specs: list[_Spec]) -> list[int]:
    return [torch.Size(shape).numel() * dt.itemsize for _, dt, shape in specs]


def _drain(group: Any, specs: list[_Spec], device: torch.device, *, flattened: bool) -> None:
    """Receive and drop every announced broadcast (into one scratch buffer), so that a rejected update
    leaves the sender's collectives matched and the group usable; the model is not touched."""
    sizes = _nbytes(specs)
    if flattened:
        sizes = [sum(sizes)]  # the sender posts one collective for the whole bucket
        specs = [("", torch.uint8, (sizes[0],))]
    scratch = torch.empty(max(sizes, default=0), dtype=torch.uint8, device=device)
    for (_, dt, shape), nbytes in zip(specs, sizes, strict=True):
        group.broadcast(on_the_wire(scratch[:nbytes].view(dt).view(shape)), src=0)


def _slices(flat: torch.Tensor, specs: list[_Spec]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a flattened bucket as views of its bytes (copied only where a slice's offset is
    not aligned to its dtype, which torch's view(dtype) requires)."""
    out, off = [], 0
    for (name, dt, shape), n in zip(specs, _nbytes(specs), strict=True):
        part = flat[off : off + n]
        try:
            out.append((name, part.view(dt).view(shape)))
        except RuntimeError:
            out.append((name, part.clone().view(dt).view(shape)))
        off += n
    return out


@torch.no_grad()
def _receive(engine: ReferenceEngine, specs: list[_Spec], *, flattened: bool = False) -> _Staged:
    """Receive one update's broadcasts, in announced order, into staging buffers (worker thread).

    Every name and shape is checked against the model first (`receive_targets`); a bad one fails the
    update before any byte moves (the broadcasts are drained, so the sender is not left hanging).
    Then each tensor is received into a buffer of its own, posted asynchronously and waited together
    as the sender does; only when every broadcast arrived are they staged for the swap. A broken group
    or a timeout therefore leaves the live weights exactly as they were (the price: one buffer per
    update, the update's size, instead of receiving into the parameters).

    flattened=True is SGLang's load_format="flattened_bucket": the sender broadcasts one uint8 tensor
    holding every tensor's bytes back to back, in announced order, without padding (the layout of
    SGLang's FlattenedTensorBucket); it is received into one buffer and sliced.
    """
    import torch.distributed as dist

    group = engine.weight_group
    if group is None:
        raise RuntimeError("the weight update group was destroyed during the update")
    if group.announces_sizes():
        check_size_preamble(engine, group, specs)
    try:
        engine.receive_targets(specs)
    except (KeyError, ValueError):
        _drain(group, specs, engine.device, flattened=flattened)
        raise
    if flattened:
        flat = torch.empty(sum(_nbytes(specs)), dtype=torch.uint8, device=engine.device)
        group.broadcast(flat, src=0)
        return engine.stage_weights(_slices(flat, specs), cast=True, owned=True)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    received = [(name, torch.empty(shape, dtype=dtype, device=engine.device)) for name, dtype, shape in specs]
    works = [group.pg.broadcast([on_the_wire(buf)], opts) for _, buf in received]
    for w in works:
        w.wait()
    return engine.stage_weights(received, cast=True, owned=True)


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body: UpdateWeightsFromDistributedRequest = await _parse(request, UpdateWeightsFromDistributedRequest)
    if engine.weight_group is None or engine.weight_group.name != body.group_name:
        return _result(
            False, f"no weight update group {body.group_name!r}; call /init_weights_update_group first"
        )
    if not len(body.names) == len(body.dtypes) == len(body.shapes):
        return _result(False, "names, dtypes and shapes must have the same length")
    if body.load_format not in (None, _FLATTENED):
        return _result(
            False, f"load_format {body.load_format!r} is not supported; use None or {_FLATTENED!r}"
        )
    flattened = body.load_format == _FLATTENED
    try:
        specs = _specs(body)
    except ValueError as e:
        return _refused("update_weights_from_distributed", engine, e)
    try:
        n = await _install(engine, body, lambda: _receive(engine, specs, flattened=flattened))
    except UpdateRefused as e:
        return _refused("update_weights_from_distributed", engine, e)
    return _result(True, f"Succeeded to update {n} parameters.")


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not request.app[_ALLOW_TENSOR_KEY]:
        return web.json_response(
            {
                "success": False,
                "message": "update_weights_from_tensor unpickles request data and is disabled; "
                "start the engine with --allow-tensor-updates on a trusted network",
            },
            status=403,
        )
    body: UpdateWeightsFromTensorRequest = await _parse(request, UpdateWeightsFromTensorRequest)
    if body.load_format not in (None, "direct"):
        return _result(False, f"load_format {body.load_format!r} is not supported; send named tensors (None)")
    if len(body.serialized_named_tensors) != 1:
        return _result(False, "serialized_named_tensors needs exactly one entry (the engine is one TP rank)")
    held = request.app[_IPC_HELD_KEY]
    try:
        named = await engine.run_in_worker(loads_named_tensors, body.serialized_named_tensors[0])
    except Exception as e:  # a bad payload of any kind is the caller's error, reported, never raised
        held.clear()
        return _refused("update_weights_from_tensor", engine, UpdateRefused(f"{type(e).__name__}: {e}"))
    # The mapped buffers stay mapped until the version is set: a sender that reuses its buffers
    # (lockstep.weights.ipc) is mapped once per update, not once per bucket (torch's IPC cache).
    held.append(named)
    try:
        # Loaded straight from the sender's buffers (no staging copy): they are ours until we
        # answer, and commit_weights finishes the copies before that.
        n = await _install(engine, body, lambda: engine.stage_weights(named, cast=True, owned=True))
    except UpdateRefused as e:
        held.clear()
        return _refused("update_weights_from_tensor", engine, e)
    if body.weight_version is not None:
        held.clear()
    return _result(True, f"Succeeded to update {n} parameters.")


async def update_weight_version(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body: UpdateWeightVersionRequest = await _parse(request, UpdateWeightVersionRequest)
    try:
        version = engine.check_version(body.new_version)
    except EngineInputError as e:
        return _result(False, str(e), weight_version=str(engine.weight_version))
    if body.abort_all_requests:
        await engine.abort(None, message="aborted for a weight version update")
    assert version is not None
    async with engine.exclusive():
        engine.set_weight_version(version)
    request.app[_IPC_HELD_KEY].clear()  # the update is over: unmap its CUDA IPC buffers
    return _result(True, f"Weight version updated to {version}", new_version=str(version))


async def metrics(request: web.Request) -> web.Response:
    """SGLang's GET /metrics (with --enable-metrics): the `sglang:*` series the reference engine
    measures (lockstep.engine.metrics.SGLangCollector), in Prometheus' text format."""
    body = generate_latest(sglang_registry(request.app[ENGINE_KEY]))
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    cfg = engine.model.config
    return web.json_response(
        {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "is_generation": True,
            "weight_version": str(engine.weight_version),
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
        }
    )


async def list_models(request: web.Request) -> web.Response:
    """SGLang's GET /v1/models: the base's card with the context length (`max_model_len`, which the
    runtime's client reads to ask only for what fits), then one card per loaded LoRA adapter (its
    parent the base), as SGLang lists them: which adapter versions this engine holds."""
    engine = request.app[ENGINE_KEY]
    base = str(engine.model_path)
    cards: list[dict[str, Any]] = [
        {"id": base, "object": "model", "root": base, "max_model_len": engine.context_length}
    ]
    listing = engine.adapters.listing() if engine.adapters is not None else {}
    cards += [{"id": n, "object": "model", "root": path, "parent": base} for n, path in listing.items()]
    return web.json_response({"object": "list", "data": cards})


async def engine_stats(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    s = engine.stats
    return web.json_response(
        {
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
            "generated_tokens": s.generated_tokens,
            "steps": s.steps,
            "requests": s.requests,
            "paused": engine.is_paused,
            "weight_version": engine.weight_version,
            "adapter_tokens": dict(s.adapter_tokens),
            "session_turns": dict(s.session_turns),
            "loaded_adapters": engine.adapters.listing() if engine.adapters is not None else {},
        }
    )


@web.middleware
async def _input_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        resp: web.StreamResponse = await handler(request)
        return resp
    except EngineInputError as e:
        return _bad(str(e))
    except EngineBusy as e:
        return web.json_response({"error": str(e)}, status=503, headers={"Retry-After": "1"})


OPEN_READS = frozenset({"/health", "/health_generate", "/model_info", "/engine_stats", "/metrics"})
"""GET routes served without the key (probes and monitoring); every other route needs it."""
MAX_BODY_BYTES = 32 << 20
"""Default request body cap: a batch of 1024 prompts of 4K tokens fits; beyond it, HTTP 413."""


def create_app(
    engine: ReferenceEngine,
    *,
    allow_tensor_updates: bool = False,
    stock: bool = False,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    weight_group_timeout_s: float = 120.0,
    weights_roots: cabc.Sequence[str | Path] | None = None,
    disk_read_timeout_s: float = DISK_READ_TIMEOUT_S,
) -> web.Application:
    """The aiohttp app serving `engine`; it starts the engine on startup and closes it on cleanup.

    stock=True serves only what stock SGLang serves (no extension route or reply field).
    api_key: required as `Authorization: Bearer <key>` on every route but OPEN_READS (SGLang's
    --api-key); max_body_bytes: larger bodies get 413; weight_group_timeout_s bounds a weight-group
    join. weights_roots: the directories /update_weights_from_disk may read from (None: any), within
    disk_read_timeout_s (lockstep.engine.disk_reads). On shutdown (SIGTERM) the engine stops
    admitting (503) and /health answers 503.
    """
    app = web.Application(
        middlewares=[bearer_middleware(api_key, open_reads=OPEN_READS), _input_errors],
        client_max_size=max_body_bytes,
    )
    app[ENGINE_KEY] = engine
    app[_ALLOW_TENSOR_KEY] = allow_tensor_updates
    app[_IPC_HELD_KEY] = []
    app[_DISK_POLICY_KEY] = DiskPolicy.of(weights_roots, disk_read_timeout_s)
    app[_JOIN_KEY] = {"join": None}
    app[_JOIN_TIMEOUT_KEY] = float(weight_group_timeout_s)
    r = app.router
    r.add_post("/generate", generate)
    r.add_post("/abort_request", abort_request)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    r.add_get("/flush_cache", flush_cache)
    r.add_post("/flush_cache", flush_cache)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/init_weights_update_group", init_weights_update_group)
    r.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    r.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    r.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    r.add_post("/update_weight_version", update_weight_version)
    r.add_get("/model_info", model_info)
    r.add_get("/metrics", metrics)
    r.add_get("/v1/models", list_models)
    r.add_post("/v1/detokenize", detokenize)
    r.add_post("/detokenize", detokenize)
    weights_checker.register(app, engine)
    lora_routes.register(app, engine)

    async def _start(app: web.Application) -> None:
        await engine.start()

    async def _stop(app: web.Application) -> None:
        await engine.close()

    async def _drain(app: web.Application) -> None:
        engine.draining = True
        join = app[_JOIN_KEY].get("join")
        if join is not None:
            join.cancelled = True

    app.on_startup.append(_start)
    app.on_shutdown.append(_drain)
    app.on_cleanup.append(_stop)
    if stock:
        return app
    r.add_get("/engine_stats", engine_stats)
    try:
        ext = importlib.import_module(_EXT_MODULE)
    except ModuleNotFoundError as e:
        if e.name != _EXT_MODULE:
            raise
    else:
        ext.register(app, engine)
    return app
