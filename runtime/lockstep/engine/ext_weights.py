"""The reference engine's one extension beyond stock SGLang: the P2P receive side (§7.2.3).

Why it exists: the pinned SGLang can serve its weights to a new instance over Mooncake's
TransferEngine (/remote_instance_transfer_engine_info), but it has no endpoint through which a
trainer writes a new version into it and activates it (Miles' SGLang fork adds its own; see
docs/sglang.md). The reference engine adds one, documented, and the operator refuses the p2p
transport for `engine: sglang` unless the pool declares an image that serves it:

- GET  /p2p_receiver_info: this engine's P2P target info (TransferEngine session, receive buffer
  address and the slot of every weight); the buffer is created and registered on first use.
- POST /p2p_receiver_commit {version, checksums}: verify what arrived in the receive buffer and only
  then load it into the live weights and set the weight version (400 naming the damaged tensors).

Stock mode (`lockstep engine --stock`) leaves it out. The pre-flight runs on SGLang's own
/weights_checker (lockstep.engine.weights_checker).

Who calls it: lockstep.engine.server.create_app calls register(app, engine); the client is
lockstep.weights.p2p.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import ValidationError

from lockstep.engine.core import ReferenceEngine
from lockstep.weights.p2p import (
    P2P_COMMIT_ROUTE,
    P2P_INFO_ROUTE,
    P2PCommitRequest,
    P2PReceiver,
    P2PWriteError,
)

_ENGINE = web.AppKey("lockstep_weights_engine", ReferenceEngine)
_RECEIVER = web.AppKey("lockstep_p2p_receiver", dict)  # {"receiver": P2PReceiver} once created


async def _body(request: web.Request, model: Any) -> Any:
    try:
        return model.model_validate(await request.json() if request.can_read_body else {})
    except (ValidationError, ValueError) as e:
        raise web.HTTPBadRequest(text=f'{{"error": {str(e)!r}}}', content_type="application/json") from e


def _receiver(app: web.Application, engine: ReferenceEngine) -> P2PReceiver:
    holder = app[_RECEIVER]
    if "receiver" not in holder:
        # A quantized engine receives its quantized weights and scales in the converted checkpoint's
        # layout (SGLang's, expert weights per expert), and dequantizes them on commit like every other update.
        holder["receiver"] = P2PReceiver(engine.update_layout())
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
            {"success": False, "message": f"call GET {P2P_INFO_ROUTE} first"}, status=400
        )
    try:  # a transaction, as every weight update: check, stage, then swap; the version last
        engine.check_version(body.version, new_weights=True)
        async with engine.exclusive():
            named = await engine.run_in_worker(receiver.verified, body)
            staged = await engine.run_in_worker(lambda: engine.stage_weights(named, cast=True))
            n = await engine.run_in_worker(engine.commit_weights, staged)
            engine.flush_cache()
            engine.set_weight_version(body.version, new_weights=True)
    except (P2PWriteError, KeyError, ValueError) as e:
        message = f"p2p commit refused: {e}; the served weights and weight_version {engine.weight_version} are unchanged"
        return web.json_response({"success": False, "message": message}, status=400)
    return web.json_response({"success": True, "message": f"loaded {n} tensors at version {body.version}"})


def register(app: web.Application, engine: ReferenceEngine) -> None:
    """Add the P2P receive extension to the engine's app (called by create_app)."""
    app[_ENGINE] = engine
    app[_RECEIVER] = {}
    app.router.add_get(P2P_INFO_ROUTE, p2p_info)
    app.router.add_post(P2P_COMMIT_ROUTE, p2p_commit)

    async def _close(app: web.Application) -> None:
        receiver = app[_RECEIVER].pop("receiver", None)
        if receiver is not None:
            receiver.close()

    app.on_cleanup.append(_close)
