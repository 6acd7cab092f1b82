"""POST /weights_checker on the reference engine, with the semantics of SGLang's WeightChecker.

Why it exists: the pre-flight (lockstep.weights.preflight) proves an update reached every weight by
calling SGLang's own /weights_checker (CheckWeightsReqInput); the reference engine must answer it the
same way so the pre-flight that passes here is the one that runs against stock SGLang. Actions:
`snapshot` copies every weight aside, `reset_tensors` fills every weight with noise, `compare` checks
the live weights against the snapshot (HTTP 400, one `name=... max_abs_err=...` line per differing
tensor, as SGLang words it) and drops the snapshot, `checksum` hashes every weight with SGLang's CPU
tensor_hash (lockstep.weights.preflight.tensor_hash). `skip_tensor_list` holds name substrings that
all four actions leave out. The engine has no speculative draft model: selector `draft` is refused.

Who calls it: lockstep.engine.server.create_app registers `handle`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import torch
from aiohttp import web
from pydantic import ValidationError

from lockstep.engine.core import ReferenceEngine
from lockstep.serving.payloads import CheckWeightsRequest
from lockstep.weights.preflight import tensor_hash

ENGINE = web.AppKey("weights_checker_engine", ReferenceEngine)
SNAPSHOT = web.AppKey("weights_checker_snapshot", dict)
"""{"tensors": {name: CPU copy}} while a snapshot is held."""


def _kept(weights: dict[str, torch.Tensor], skip: Sequence[str] | None) -> dict[str, torch.Tensor]:
    return {n: t for n, t in weights.items() if not any(s in n for s in (skip or ()))}


@torch.no_grad()
def _reset(weights: dict[str, torch.Tensor], seed: int) -> int:
    g = torch.Generator(device="cpu").manual_seed(seed)
    for t in weights.values():
        noise = torch.rand(t.shape, generator=g, dtype=torch.float32)  # [*shape] in [0, 1), as SGLang
        t.copy_(noise.to(t.device, t.dtype) if t.is_floating_point() else (noise * 100).to(t.device, t.dtype))
    return len(weights)


def _differences(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> list[str]:
    """One line per tensor whose live copy differs from its snapshot (SGLang's message shape)."""
    lines = []
    for name, want in expected.items():
        have = actual.get(name)
        if have is None:
            lines.append(f"name={name} missing from the model")
            continue
        have = have.detach().cpu()
        if have.shape != want.shape or have.dtype != want.dtype:
            lines.append(
                f"name={name} layout expect={want.dtype}{list(want.shape)} actual={have.dtype}{list(have.shape)}"
            )
        elif not torch.equal(have, want):
            diff = (have.float() - want.float()).abs()
            lines.append(
                f"name={name} max_abs_err={diff.max().item()} mean_abs_err={diff.mean().item()} "
                f"num_exceed={int((diff > 0).sum())}"
            )
    return lines


def _checksum(weights: dict[str, torch.Tensor]) -> dict[str, object]:
    checksums = {n: tensor_hash(t) for n, t in sorted(weights.items())}
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    rank = {
        "checksums": checksums,
        "per_gpu_checksum": h.hexdigest(),
        "parallelism_info": {
            "role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
            "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1,
        },
    }  # fmt: skip
    engine_sum = hashlib.sha256(str(rank["per_gpu_checksum"]).encode()).hexdigest()
    return {"success": True, "message": "Success.", "ranks": [rank], "per_engine_checksum": engine_sum}


def _reply(success: bool, message: str) -> web.Response:
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)


async def handle(request: web.Request) -> web.Response:
    """POST|GET /weights_checker (an empty body is SGLang's default: checksum)."""
    raw = await request.read()
    try:
        body = CheckWeightsRequest.model_validate(json.loads(raw) if raw else {})
    except (ValidationError, ValueError) as e:
        return web.json_response({"error": f"/weights_checker: invalid body: {e}"}, status=400)
    if body.selector == "draft":
        return _reply(
            False, "selector 'draft': this engine has no speculative draft model; use 'target' or 'all'"
        )
    engine, held = request.app[ENGINE], request.app[SNAPSHOT]
    async with engine.exclusive():
        weights = _kept(engine.named_weights(), body.skip_tensor_list)
        if body.action == "snapshot":
            held["tensors"] = await engine.run_in_worker(
                lambda: {n: t.detach().cpu().clone() for n, t in weights.items()}
            )
            return _reply(True, f"Snapshot of {len(weights)} tensors.")
        if body.action == "reset_tensors":
            n = await engine.run_in_worker(_reset, weights, engine.weight_version)
            engine.flush_cache()  # cached KV was computed by the old weights
            return _reply(True, f"Reset {n} tensors.")
        if body.action == "compare":
            snapshot = held.pop("tensors", None)
            if snapshot is None:
                return _reply(False, "compare needs a snapshot: call action 'snapshot' first")
            lines = await engine.run_in_worker(_differences, snapshot, weights)
            if lines:
                return _reply(False, "check tensor equality failed:\n" + "\n".join(lines))
            return _reply(True, f"{len(snapshot)} tensors equal to the snapshot.")
        return web.json_response(await engine.run_in_worker(_checksum, weights))


def register(app: web.Application, engine: ReferenceEngine) -> None:
    """Serve /weights_checker for `engine` (GET and POST, as SGLang)."""
    app[ENGINE] = engine
    app[SNAPSHOT] = {}
    app.router.add_post("/weights_checker", handle)
    app.router.add_get("/weights_checker", handle)
