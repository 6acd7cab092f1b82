"""SGLang's LoRA routes on the reference engine: /load_lora_adapter, /load_lora_adapter_from_tensors,
/unload_lora_adapter.

Why it exists: a LoRA job updates only its adapter on the engines, through these stock SGLang routes
(docs/lora.md), and several jobs share one engine, each loading its adapters by name. Semantics follow
the pinned SGLang (tokenizer_control_mixin.py, lora_manager.py, tp_worker.py):
- a name already loaded is refused (an adapter's weights never change under its name, so the tokens
  a request sampled with it were sampled by exactly those weights);
- the load is validated in full before it becomes visible (rank within --max-lora-rank, targets within
  --lora-target-modules, shapes; with expected_checksums the sha256 of every tensor's bytes, missing or
  extra tensors fail it, as SGLang's [LORA-CHECK]); a failed load changes nothing;
- unload stops new requests from naming the adapter, waits for the requests that use it, then frees it;
- replies are SGLang's LoRAUpdateOutput {success, error_message, loaded_adapters}, 400 on failure.
Loading an adapter never touches the base weights, never pauses generation and changes no other
adapter: requests of other adapters keep sampling exactly as before.

Who calls it: lockstep.engine.server (registers the routes when LoRA is enabled).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from lockstep.engine.core import EngineInputError, ReferenceEngine
from lockstep.engine.lora import AdapterError, AdapterSet
from lockstep.serving.guard import parse_json
from lockstep.serving.payloads import (
    LoadLoraAdapterFromTensorsRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
from lockstep.serving.tensor_codec import loads_named_tensors

log = logging.getLogger(__name__)

TENSOR_PATH = "__tensor__"
"""The path SGLang records for an adapter loaded from tensors."""


def _reply(adapters: AdapterSet | None, error: str | None = None) -> web.Response:
    body: dict[str, Any] = {"success": error is None, "error_message": error}
    body["loaded_adapters"] = adapters.listing() if adapters is not None else {}
    return web.json_response(body, status=200 if error is None else 400)


def tensor_sha256(t: torch.Tensor) -> str:
    """SGLang's adapter-sync checksum: sha256 of the tensor's bytes, contiguous, on the CPU."""
    return hashlib.sha256(
        t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
    ).hexdigest()


def check_checksums(tensors: dict[str, torch.Tensor], expected: dict[str, str]) -> None:
    """Raise AdapterError listing value-differing, missing and extra tensors (SGLang's check)."""
    mismatch = sorted(n for n, want in expected.items() if n in tensors and tensor_sha256(tensors[n]) != want)
    missing = sorted(n for n in expected if n not in tensors)
    extra = sorted(n for n in tensors if n not in expected)
    if mismatch or missing or extra:
        raise AdapterError(
            f"[LORA-CHECK] adapter sync MISMATCH of {len(expected)} expected: {len(mismatch)} value-diff "
            f"{mismatch[:5]}, {len(missing)} missing {missing[:5]}, {len(extra)} extra {extra[:5]}"
        )


async def _body(request: web.Request, model: Any) -> Any:
    try:
        return model.model_validate(parse_json(await request.read()))
    except ValueError as e:
        raise AdapterError(f"{request.path}: invalid body: {e}") from e


def _read_dir(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    import json

    from safetensors.torch import load_file

    d = Path(path)
    weights, config = d / "adapter_model.safetensors", d / "adapter_config.json"
    if not weights.is_file() or not config.is_file():
        raise AdapterError(f"lora_path {path!r} holds no adapter_model.safetensors and adapter_config.json")
    return dict(load_file(str(weights))), json.loads(config.read_text())


async def _load(
    engine: ReferenceEngine,
    name: str,
    read: Any,
    config: dict[str, Any] | None,
    path: str,
    expected: dict[str, str] | None = None,
) -> None:
    """Read, check and build on the worker thread, then add between steps."""
    adapters = engine.adapters
    assert adapters is not None

    def build() -> Any:
        tensors, cfg = read()
        if expected is not None:
            check_checksums(tensors, expected)
        return adapters.build(name, tensors, config if config is not None else cfg, path=path)

    adapter = await engine.run_in_worker(build)
    async with engine.exclusive():
        if name in adapters.adapters:  # a concurrent load of the same name won
            raise AdapterError(f"Failed to load LoRA adapter {name} because it is already loaded")
        adapters.add(adapter)
    log.info(
        "loaded LoRA adapter %s (rank %d, %d modules) from %s", name, adapter.rank, len(adapter.weights), path
    )


def _disabled() -> str:
    return "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


async def load_lora_adapter(request: web.Request, engine: ReferenceEngine) -> web.Response:
    if engine.adapters is None:
        return _reply(None, _disabled())
    try:
        body: LoadLoraAdapterRequest = await _body(request, LoadLoraAdapterRequest)
        await _load(engine, body.lora_name, lambda: _read_dir(body.lora_path), None, body.lora_path)
    except (AdapterError, OSError) as e:
        return _reply(engine.adapters, str(e))
    return _reply(engine.adapters)


async def load_lora_adapter_from_tensors(request: web.Request, engine: ReferenceEngine) -> web.Response:
    if engine.adapters is None:
        return _reply(None, _disabled())
    try:
        body: LoadLoraAdapterFromTensorsRequest = await _body(request, LoadLoraAdapterFromTensorsRequest)
        if body.load_format not in (None, "direct"):
            raise AdapterError(
                f"load_format {body.load_format!r} is not supported; send named tensors (None)"
            )
        if len(body.serialized_named_tensors) != 1:
            raise AdapterError("serialized_named_tensors needs exactly one entry (the engine is one TP rank)")
        payload = body.serialized_named_tensors[0]

        def read() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
            try:
                return dict(loads_named_tensors(payload)), body.config_dict
            except Exception as e:  # a bad payload is the caller's error
                raise AdapterError(f"serialized_named_tensors: {type(e).__name__}: {e}") from e

        await _load(engine, body.lora_name, read, body.config_dict, TENSOR_PATH, body.expected_checksums)
    except AdapterError as e:
        return _reply(engine.adapters, str(e))
    return _reply(engine.adapters)


async def unload_lora_adapter(request: web.Request, engine: ReferenceEngine) -> web.Response:
    if engine.adapters is None:
        return _reply(None, _disabled())
    try:
        body: UnloadLoraAdapterRequest = await _body(request, UnloadLoraAdapterRequest)
        await engine.unload_adapter(body.lora_name)
    except (AdapterError, EngineInputError) as e:
        return _reply(engine.adapters, str(e))
    log.info("unloaded LoRA adapter %s", body.lora_name)
    return _reply(engine.adapters)


def register(app: web.Application, engine: ReferenceEngine) -> None:
    """Add the three routes (served whether or not LoRA is enabled, as SGLang serves them: without
    --enable-lora they answer its error)."""

    def bind(handler: Any) -> Any:
        async def route(request: web.Request) -> web.Response:
            response: web.Response = await handler(request, engine)
            return response

        return route

    app.router.add_post("/load_lora_adapter", bind(load_lora_adapter))
    app.router.add_post("/load_lora_adapter_from_tensors", bind(load_lora_adapter_from_tensors))
    app.router.add_post("/unload_lora_adapter", bind(unload_lora_adapter))
