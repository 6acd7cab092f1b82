"""Our engine extensions for weight transfer: pre-flight noise and checksums, and the P2P receive side.

Why it exists: stock SGLang has no endpoint to overwrite weights with noise, to checksum them, or to
receive Mooncake P2P writes (Miles' SGLang fork adds its own; see docs/weights.md). The reference
engine needs them for the pre-flight check (seed §7.2.5) and the P2P transport (seed §7.2.3), so
they are added here as explicit, documented extensions under the /lockstep/ prefix:

- POST /lockstep/weights/randomize {seed}: overwrite every weight with seeded noise (before the first
  update only; the pre-flight then proves the update overwrote all of it).
- POST /lockstep/weights/checksums {names?}: dtype, shape and xxh3-128 of each weight, by HF name.
- GET  /lockstep/p2p/info: this engine's P2P target info (TransferEngine session, receive buffer
  address and the slot of every weight); the buffer is created and registered on first use.
- POST /lockstep/p2p/commit {version, checksums}: verify what arrived in the receive buffer and only
  then load it into the live weights and set the weight version (400 naming the damaged tensors).

Who calls it: lockstep.engine.server.create_app calls register(app, engine); the clients are
lockstep.weights.preflight and lockstep.weights.p2p.
"""

from __future__ import annotations

from typing import Any

import torch
from aiohttp import web
from pydantic import ValidationError

from lockstep.engine.core import ReferenceEngine
from lockstep.weights.p2p import P2PCommitRequest, P2PReceiver, P2PWriteError
from lockstep.weights.preflight import (
    CHECKSUMS_PATH,
    RANDOMIZE_PATH,
    ChecksumsReply,
    ChecksumsRequest,
    RandomizeRequest,
    summarize,
)

_ENGINE = web.AppKey("lockstep_weights_engine", ReferenceEngine)
_RECEIVER = web.AppKey("lockstep_p2p_receiver", dict)  # {"receiver": P2PReceiver} once created


async def _body(request: web.Request, model: Any) -> Any:
    try:
        return model.model_validate(await request.json() if request.can_read_body else {})
    except (ValidationError, ValueError) as e:
        raise web.HTTPBadRequest(text=f'{{"error": {str(e)!r}}}', content_type="application/json") from e


@torch.no_grad()
def _randomize(engine: ReferenceEngine, seed: int) -> int:
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = 0
    for _, t in sorted(engine.named_weights().items()):
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)  # [*shape] on CPU, then moved
        t.copy_(
            noise.to(device=t.device, dtype=t.dtype)
            if t.is_floating_point()
            else noise.round().to(t.device, t.dtype)
        )
        n += 1
    return n


async def randomize(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE]
    body: RandomizeRequest = await _body(request, RandomizeRequest)
    async with engine.exclusive():
        n = await engine.run_in_worker(_randomize, engine, body.seed)
        engine.flush_cache()  # cached KV was computed by the old weights
    return web.json_response({"success": True, "message": f"randomized {n} tensors", "tensors": n})


async def checksums(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE]
    body: ChecksumsRequest = await _body(request, ChecksumsRequest)

    def run() -> ChecksumsReply:
        weights = engine.named_weights()
        names = body.names if body.names is not None else sorted(weights)
        return ChecksumsReply(
            tensors={n: summarize(weights[n]) for n in names if n in weights},
            weight_version=str(engine.weight_version),
        )

    async with engine.exclusive():
        reply = await engine.run_in_worker(run)
    return web.json_response(reply.model_dump(mode="json"))


def _receiver(app: web.Application, engine: ReferenceEngine) -> P2PReceiver:
    holder = app[_RECEIVER]
    if "receiver" not in holder:
        expected = {n: (t.dtype, tuple(t.shape)) for n, t in engine.named_weights().items()}
        holder["receiver"] = P2PReceiver(expected)
    receiver: P2PReceiver = holder["receiver"]
    return receiver


async def p2p_info(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE]
    try:
        receiver = await engine.run_in_worker(_receiver, request.app, engine)
    except (ImportError, P2PWriteError) as e:
        return web.json_response({"error": f"P2P receive side unavailable: {e}"}, status=503)
    return web.json_response(receiver.info().model_dump(mode="json"))


async def p2p_commit(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE]
    body: P2PCommitRequest = await _body(request, P2PCommitRequest)
    receiver = request.app[_RECEIVER].get("receiver")
    if receiver is None:
        return web.json_response(
            {"success": False, "message": "call GET /lockstep/p2p/info first"}, status=400
        )
    try:  # a transaction, as every weight update: check, stage, then swap; the version last
        engine.check_version(body.version)
        async with engine.exclusive():
            named = await engine.run_in_worker(receiver.verified, body)
            staged = await engine.run_in_worker(lambda: engine.stage_weights(named, cast=True))
            n = await engine.run_in_worker(engine.commit_weights, staged)
            engine.flush_cache()
            engine.set_weight_version(body.version)
    except (P2PWriteError, KeyError, ValueError) as e:
        message = f"p2p commit refused: {e}; the served weights and weight_version {engine.weight_version} are unchanged"
        return web.json_response({"success": False, "message": message}, status=400)
    return web.json_response({"success": True, "message": f"loaded {n} tensors at version {body.version}"})


def register(app: web.Application, engine: ReferenceEngine) -> None:
    """Add the weight extensions to the engine's app (called by create_app)."""
    app[_ENGINE] = engine
    app[_RECEIVER] = {}
    app.router.add_post(RANDOMIZE_PATH, randomize)
    app.router.add_post(CHECKSUMS_PATH, checksums)
    app.router.add_get("/lockstep/p2p/info", p2p_info)
    app.router.add_post("/lockstep/p2p/commit", p2p_commit)

    async def _close(app: web.Application) -> None:
        receiver = app[_RECEIVER].pop("receiver", None)
        if receiver is not None:
            receiver.close()

    app.on_cleanup.append(_close)
