"""The runtime's HTTP contract with SGLang, checked against the pinned SGLang's own source.

- every route EngineClient calls is served by SGLang with the same method (entrypoints/http_server.py);
- every body EngineClient sends converts into the request struct SGLang's handler for that route takes
  (managers/io_struct.py), with no unknown, missing or mistyped field; /generate also passes SGLang's
  own contract gate (entrypoints/api_contract.py);
- the client reuses an idle connection only for less time than SGLang's server keeps it open, so it never
  sends on a connection the server is closing;
- the reference engine serves exactly SGLang routes (plus the extensions it declares, none in stock
  mode), and its replies decode with SGLang's reply types and use SGLang's field names.
"""

from __future__ import annotations

import ast
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from lockstep.engine import ReferenceEngine, create_app
from lockstep.models.tiny import materialize_builtin
from lockstep.serving import EngineClient, SamplingParams
from lockstep.serving.http import KEEPALIVE_S
from lockstep.serving.payloads import ROUTES
from lockstep.weights.p2p import P2P_COMMIT_ROUTE, P2P_INFO_ROUTE
from sglang_oracle import (
    check_body,
    generate_contract_error,
    handler_struct,
    mounted_routes,
    msgspec,
    require_pinned_sglang,
    served_routes,
    source,
)


def _detokenize_request() -> Any:
    from sglang.srt.entrypoints.openai.protocol import DetokenizeRequest

    return DetokenizeRequest


OPENAI_BODIES = {"/v1/detokenize": _detokenize_request}
"""Routes whose SGLang handler takes an OpenAI-protocol pydantic model, not an io_struct `obj`."""

EXTENSIONS = {("GET", "/engine_stats"), ("GET", P2P_INFO_ROUTE), ("POST", P2P_COMMIT_ROUTE)}
"""What the reference engine serves beyond SGLang (docs/sglang.md); none of it in stock mode."""


@pytest.fixture(autouse=True, scope="module")
def _pinned() -> None:
    require_pinned_sglang()


def test_every_route_the_client_calls_is_served_by_sglang() -> None:
    routes = served_routes()
    for name, (method, path) in ROUTES.items():
        assert path in routes, f"{name}: SGLang serves no {path}"
        assert method in routes[path][0], (
            f"{name}: SGLang serves {path} with {sorted(routes[path][0])}, not {method}"
        )


class Recorder:
    """Records every request and answers success, as SGLang's handlers do."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, Any]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.seen.append((request.method, request.path, json.loads(raw) if raw else None))
        if request.path == "/generate":
            body = json.loads(raw)
            meta = {"id": "r", "finish_reason": {"type": "length", "length": 1}, "weight_version": "0"}
            start = body.get("logprob_start_len", -1)
            if start >= 0:  # a scoring request: echo the scored IDs as SGLang does
                scored = body["input_ids"][start:]
                meta["input_token_logprobs"] = [
                    [None if i == 0 else -1.0, t, None] for i, t in enumerate(scored)
                ]
                cands = [None] + [[[-1.0, 1, None]]] * (len(scored) - 1)
                meta["input_top_logprobs"] = meta["input_token_ids_logprobs"] = cands
            return web.json_response({"text": "", "output_ids": [1], "meta_info": meta})
        if request.path == "/v1/detokenize":
            return web.json_response({"text": ["x"] * len(json.loads(raw)["tokens"])})
        if request.path == "/model_info":
            return web.json_response({"model_path": "/m", "weight_version": "0"})
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "/m", "object": "model"}]})
        return web.json_response({"success": True, "message": "ok"})


async def every_call(c: EngineClient) -> None:
    """Every request EngineClient can send, with every optional field it sets."""
    sp = SamplingParams(
        max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=[1], sampling_seed=3
    )
    await c.generate([5, 6, 7], sp, rid="r1", return_routed_experts=True)
    await c.generate([5, 6, 7], SamplingParams(max_new_tokens=0), logprob_start_len=0, rid="r2")
    await c.generate([5, 6, 7], SamplingParams(max_new_tokens=1, stop="x"), rid="r3", routed_dp_rank=1)
    await c.generate([5, 6, 7], SamplingParams(max_new_tokens=1), rid="r4", lora_path="job-v3")
    await c.score([5, 6, 7, 8], 2, top_k=4, token_ids=[3, 9])  # a teacher scoring a row (no sampling)
    await c.detokenize([[5], [6]])  # the teacher-student tokenizer check
    await c.abort("r1")
    await c.abort()
    await c.health_generate()
    await c.flush_cache()
    for mode in ("abort", "retract", "in_place"):
        await c.pause_generation(mode)
    await c.continue_generation()
    await c.update_weights_from_disk("/ckpt/step_3", weight_version=3, flush_cache=False)
    await c.init_weights_update_group("10.0.0.1", 29500, rank_offset=1, world_size=3, backend="gloo")
    await c.update_weights_from_distributed(
        ["model.norm.weight"], ["bfloat16"], [[64]], weight_version=4, load_format="flattened_bucket"
    )
    await c.destroy_weights_update_group()
    await c.update_weights_from_tensor(["AAAA"], weight_version=5, load_format="flattened_bucket")
    await c.update_weight_version(7, abort_all_requests=True)
    for action in ("snapshot", "reset_tensors", "compare", "checksum"):
        await c.check_weights(action, skip_tensor_list=["rotary"], allow_quant_error=True)  # type: ignore[arg-type]
    await c.model_info()
    await c.load_lora_adapter("job-v3", "/run/adapters/v3", pinned=False)
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    await c.load_lora_adapter_from_tensors("job-v4", config, "AAAA", expected_checksums={"a": "00"})
    await c.unload_lora_adapter("job-v3")
    await c.list_models()


@pytest.fixture
async def recorded() -> list[tuple[str, str, Any]]:
    rec = Recorder()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", rec.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with EngineClient(str(server.make_url("")), retries=1) as client:
            await every_call(client)
    finally:
        await server.close()
    return rec.seen


def test_the_client_drops_idle_connections_before_sglang_does() -> None:
    """SGLang's uvicorn closes a connection idle for SGLANG_TIMEOUT_KEEP_ALIVE seconds (its default; the
    env var changes it): a request sent on a connection it is closing fails after it was sent."""
    require_pinned_sglang()
    from sglang.srt.environ import envs

    assert envs.SGLANG_TIMEOUT_KEEP_ALIVE.get() > KEEPALIVE_S, (
        f"EngineClient reuses idle connections for {KEEPALIVE_S} s but SGLang closes them after "
        f"{envs.SGLANG_TIMEOUT_KEEP_ALIVE.get()} s: lower lockstep.serving.http.KEEPALIVE_S"
    )


async def test_every_body_the_client_sends_builds_sglangs_request_struct(
    recorded: list[tuple[str, str, Any]],
) -> None:
    assert {path for _, path, _ in recorded} == {path for _, path in ROUTES.values()} - {"/health"}
    for method, path, body in recorded:
        if path in OPENAI_BODIES:  # an OpenAI-protocol route: its handler takes `request: X` (pydantic)
            model = OPENAI_BODIES[path]()
            unknown = set(body) - set(model.model_fields)
            assert not unknown, f"{method} {path}: SGLang's {model.__name__} has no field {unknown}"
            model.model_validate(body)
            continue
        struct = handler_struct(path)
        if struct is None:
            assert body is None, f"{method} {path}: SGLang's handler reads no body, the client sent {body}"
            continue
        try:
            check_body(struct, body)
        except msgspec.ValidationError as e:
            pytest.fail(f"{method} {path}: the body {body} does not build SGLang's {struct}: {e}")
        if path == "/generate":
            assert generate_contract_error(body) is None, (path, body, generate_contract_error(body))


def test_the_struct_check_fails_on_a_renamed_or_missing_field() -> None:
    """The oracle can fail: what SGLang would refuse is refused here."""
    with pytest.raises(msgspec.ValidationError, match="weight_versionz"):
        check_body("UpdateWeightFromDiskReqInput", {"model_path": "/x", "weight_versionz": "1"})
    with pytest.raises(msgspec.ValidationError, match="master_port"):
        check_body(
            "InitWeightsUpdateGroupReqInput", {"master_address": "h", "rank_offset": 1, "world_size": 2}
        )
    with pytest.raises(msgspec.ValidationError, match="mode"):
        check_body("PauseGenerationReqInput", {"mode": "freeze"})
    assert "max_new_token" in str(
        generate_contract_error({"input_ids": [1], "sampling_params": {"max_new_token": 1}})
    )


# -- the reference engine against the same source ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = materialize_builtin("builtin:tiny", tmp_path_factory.mktemp("tiny"), seed=0)
    return path


def _routes(app: web.Application) -> set[tuple[str, str]]:
    return {
        (r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD" and r.resource
    }


def test_the_reference_engine_serves_sglang_routes_and_declares_its_extensions(tiny_dir: Path) -> None:
    engine = ReferenceEngine.load(tiny_dir)
    sglang = served_routes()
    stock = _routes(create_app(engine, stock=True))
    mounted = mounted_routes()
    drift = sorted(
        (m, p) for m, p in stock if (m, p) not in mounted and (p not in sglang or m not in sglang[p][0])
    )
    assert not drift, f"the stock reference engine serves routes SGLang does not: {drift}"
    assert {(m, p) for m, p in ROUTES.values()} <= stock, (
        "the client calls a route the reference engine lacks"
    )
    assert _routes(create_app(engine)) - stock == EXTENSIONS


def _dict_keys(node: ast.AST | None) -> set[str]:
    if not isinstance(node, ast.Dict):
        return set()
    return {str(k.value) for k in node.keys if isinstance(k, ast.Constant)}


def _is_meta_info_update(func: ast.expr) -> bool:
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "update"
        and getattr(func.value, "id", None) == "meta_info"
    )


def _meta_info_keys() -> set[str]:
    """Every meta_info key SGLang's tokenizer manager writes: `meta_info = {...}`,
    `meta_info.update({...})` and `meta_info["key"] = ...`."""
    tree = ast.parse(source("srt/managers/tokenizer_manager.py").read_text())
    keys: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "meta_info":
            keys |= {str(node.slice.value)} if isinstance(node.slice, ast.Constant) else set()
        elif isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "meta_info" for t in node.targets
        ):
            keys |= _dict_keys(node.value)
        elif isinstance(node, ast.Call) and _is_meta_info_update(node.func) and node.args:
            keys |= _dict_keys(node.args[0])
    return keys


@pytest.fixture
async def stock_engine(tiny_dir: Path) -> AsyncIterator[str]:
    server = TestServer(create_app(ReferenceEngine.load(tiny_dir), stock=True), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def test_the_reference_engines_replies_use_sglangs_shapes(stock_engine: str) -> None:
    import httpx
    from sglang.api.v1.api_types import GenerateMetaInfo, GenerateResponse, GetModelInfoResponse

    async with httpx.AsyncClient(base_url=stock_engine, timeout=60) as http:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
        reply = (await http.post("/generate", json=body)).json()
        decoded = GenerateResponse.from_json_value(reply)
        assert decoded.meta_info is not None and [s.end for s in decoded.meta_info.weight_versions] == [4]
        sglang_keys = set(GenerateMetaInfo.__struct_fields__) | _meta_info_keys()
        assert set(reply["meta_info"]) <= sglang_keys, set(reply["meta_info"]) - sglang_keys
        GetModelInfoResponse.from_json_value((await http.get("/model_info")).json())
        from sglang.srt.entrypoints.openai.protocol import ModelList

        models = ModelList.model_validate((await http.get("/v1/models")).json())
        assert [c.parent for c in models.data] == [None]  # the base only: LoRA is not enabled
        from sglang.srt.entrypoints.openai.protocol import DetokenizeResponse

        texts = await http.post("/v1/detokenize", json={"tokens": [[5], [6]], "skip_special_tokens": False})
        assert len(DetokenizeResponse.model_validate(texts.json()).text) == 2
        scoring = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                   "logprob_start_len": 1, "top_logprobs_num": 2, "token_ids_logprob": [3]}  # fmt: skip
        scored = (await http.post("/generate", json=scoring)).json()
        GenerateResponse.from_json_value(scored)
        assert set(scored["meta_info"]) <= sglang_keys, set(scored["meta_info"]) - sglang_keys
        assert {"input_top_logprobs", "input_token_ids_logprobs"} <= set(scored["meta_info"])
        sums = (await http.post("/weights_checker", json={"action": "checksum"})).json()
    assert set(sums) == {"success", "message", "ranks", "per_engine_checksum"}
    tree = ast.parse(source("srt/utils/weight_checker.py").read_text())
    fields = {
        c.name: {
            s.target.id for s in c.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        }
        for c in tree.body
        if isinstance(c, ast.ClassDef)
    }
    assert set(sums["ranks"][0]) == fields["ChecksumInfo"]
    assert set(sums["ranks"][0]["parallelism_info"]) == fields["ParallelismInfo"]
